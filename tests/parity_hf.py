#!/usr/bin/env python3
"""kernelforge against Hugging Face transformers on random GPT-2 models (no network needed).

Usage (from the kernelforge project folder, on a machine with torch + transformers):

    python3 tests/parity_hf.py PATH/TO/kernelforge                 # parity checks
    python3 tests/parity_hf.py PATH/TO/kernelforge --size gpt2     # throughput, 124M shape

Parity mode builds a GPT2LMHeadModel from a GPT2Config (head size 64), perturbs every
LayerNorm weight/bias and every bias with normal noise (zero biases and unit gains hide bugs),
saves it with save_pretrained (safetensors), then checks:
  - `kernelforge forward` logits vs transformers (f32, CPU reference): relative L2 below 1e-5 on
    --device cpu and below 1e-4 on --device cuda (fused and --unfused);
  - `kernelforge generate --greedy --max-new-tokens 64 --print-ids` vs transformers' greedy
    `generate` (do_sample=False), token by token, on cuda (and cpu);
  - the same model exported as an llm.c checkpoint (gpt2_124M.bin layout, version 3, f32):
    `forward --device cuda` logits and greedy generation on it against transformers too.
  - `forward --device cuda --dtype tf32` (tensor-core matmuls): relative L2 below 1e-2.
  - `forward --device cuda --dtype bf16` and `--dtype f16` (16-bit storage): relative L2 below
    2e-2 against transformers run in the same dtype on the GPU (the error against the f32
    logits is printed too), and `generate --dtype bf16 --greedy`: the first 16 tokens equal
    transformers' bf16 greedy generation.
One summary line per check; exit status 1 when any check misses.

`--size gpt2` builds a full-size random 124M model and prints throughput side by side:
transformers forward (batch 8 x 1024) and cached greedy decode (batch 1 and 8) against
`kernelforge bench ... --json`, each kernelforge dtype against transformers in the same precision
(f32 with TF32 off; `--dtype tf32` against f32 with TF32 matmuls on; bf16; f16), attention SDPA
(`--hf-attention eager` for the eager one).

With `--size gpt2` it also runs the strongest PyTorch decode peer (`--static-peer yes|no|only`):
transformers bf16 with a static KV cache (`StaticCache`) and the whole greedy decode step (model,
argmax, feeding the token and the position back) captured once in a `torch.cuda.CUDAGraph` and
replayed, at each batch of `--peer-batches` (default 1,8; e.g. 1,8,32,64,128,256), tokens/s over
--steps steps after the same prompt length kernelforge's bench uses, printed beside
`kernelforge bench --dtype bf16 --batch LIST --decode-engine graph` and `--decode-engine
megakernel` (one run each, every batch in it) with the ratios, a column per batch (`n/a` where a
side cannot run a batch, the reason below the table: the megakernel takes at most 8 sequences);
then the same sampled (--peer-sampling, default
temperature 0.8, top-k 40, top-p 0.95: top-k, top-p and the draw inside the peer's graph). Where this transformers has no StaticCache, or its
GPT-2 cannot run or be captured with one, the peer row says why and the rest still runs.
"""

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def kf_env():
    env = dict(os.environ)
    if not os.path.isdir("specs") and "KERNELFORGE_ROOT" not in env:
        env["KERNELFORGE_ROOT"] = ROOT
    return env


def run_kf(binary, args, check=True):
    cmd = [binary] + args
    p = subprocess.run(cmd, capture_output=True, text=True, env=kf_env())
    if check and p.returncode != 0:
        print(f"FAILED: {' '.join(cmd)} (exit {p.returncode})\n{p.stdout}\n{p.stderr}", file=sys.stderr)
        raise SystemExit(1)
    return p


def build_model(n_layer, n_head, n_embd, n_positions, seed, noise):
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        n_positions=n_positions,
        vocab_size=50257,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or ".ln_" in name or name.startswith("transformer.ln_f"):
                p.add_(noise * torch.randn_like(p))
    return model


def write_llmc(model, path):
    """The model as an llm.c checkpoint: a 256-int32 header (magic 20240326, version 3 = f32,
    max_T, V, L, NH, C, padded V) and the parameters in llm.c's order, Linear weights [out, in]
    (HF's Conv1D stores [in, out]: transposed here), wte padded with zero rows."""
    cfg = model.config
    c, n_layer, v = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    vp = (v + 127) // 128 * 128
    sd = {k: t.detach().float().numpy() for k, t in model.state_dict().items()}
    h = [f"transformer.h.{i}." for i in range(n_layer)]
    stack = lambda name, transpose=False: np.stack([sd[p + name].T if transpose else sd[p + name] for p in h])
    wte = np.zeros((vp, c), np.float32)
    wte[:v] = sd["transformer.wte.weight"]
    tensors = [wte, sd["transformer.wpe.weight"], stack("ln_1.weight"), stack("ln_1.bias"),
               stack("attn.c_attn.weight", True), stack("attn.c_attn.bias"),
               stack("attn.c_proj.weight", True), stack("attn.c_proj.bias"),
               stack("ln_2.weight"), stack("ln_2.bias"), stack("mlp.c_fc.weight", True), stack("mlp.c_fc.bias"),
               stack("mlp.c_proj.weight", True), stack("mlp.c_proj.bias"),
               sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"]]
    header = np.zeros(256, np.int32)
    header[:8] = [20240326, 3, cfg.n_positions, v, n_layer, cfg.n_head, c, vp]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        for t in tensors:
            f.write(np.ascontiguousarray(t, dtype=np.float32).tobytes())


def rel_l2(got, want):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return float("inf")
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            do_sample=False,
            max_new_tokens=n,
            pad_token_id=50256,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    return out[0, len(ids):].tolist()


def top2_gap(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def parity(args):
    results = []
    # f32 is always checked (the reference path); --dtypes picks the others (a GPU standing in
    # for a T4 has no tf32)
    dtypes = set(args.dtypes.split(","))

    def report(name, ok, detail):
        results.append(ok)
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

    model = build_model(args.layers, 4, 256, 256, args.seed, args.noise)
    rng = np.random.default_rng(args.seed)
    ids = rng.integers(0, 50257, size=args.tokens).tolist()
    ids_text = ",".join(map(str, ids))
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].float().numpy()
    with tempfile.TemporaryDirectory() as tmp:
        mdir = os.path.join(tmp, "model")
        model.save_pretrained(mdir, safe_serialization=True)
        llmc = os.path.join(tmp, "model.bin")
        write_llmc(model, llmc)
        devices = ["cpu", "cuda"] if not args.cpu_only else ["cpu"]
        checks = [(mdir, "cpu", [], 1e-5), (mdir, "cuda", [], 1e-4), (mdir, "cuda", ["--unfused"], 1e-4),
                  (llmc, "cuda", [], 1e-4)] + [(mdir, "cuda", ["--dtype", "tf32"], 1e-2)] * ("tf32" in dtypes)
        for path, device, extra, tol in checks:
            if device not in devices:
                continue
            out = os.path.join(tmp, f"logits-{device}{''.join(extra)}-{os.path.basename(path)}.npy")
            run_kf(args.binary, ["forward", "--model", path, "--device", device, "--ids", ids_text,
                                 "--logits-out", out] + extra)
            got = np.load(out)
            e = rel_l2(got, want)
            label = f"forward {device}{' ' + ' '.join(extra) if extra else ''}{' (llm.c file)' if path == llmc else ''}"
            report(label, e < tol,
                   f"relative L2 {e:.3e} (target < {tol:.0e}), shape {got.shape} vs {want.shape}, "
                   f"max |diff| {float(np.max(np.abs(got.astype(np.float64) - want))):.3e}")

        prompt = ids[: args.prompt_tokens]
        hf_tokens = hf_greedy(model, prompt, args.new_tokens)
        for path, device in [(mdir, d) for d in devices] + [(llmc, "cuda")] * ("cuda" in devices):
            name = f"greedy generate {device}{' (llm.c file)' if path == llmc else ''}"
            p = run_kf(args.binary, ["generate", "--model", path, "--device", device,
                                     "--ids", ",".join(map(str, prompt)), "--greedy",
                                     "--max-new-tokens", str(args.new_tokens), "--print-ids"])
            lines = [l for l in p.stdout.strip().splitlines() if l.strip()]
            kf_tokens = [int(x) for x in lines[-1].split(",")] if lines else []
            if kf_tokens == hf_tokens:
                stats = (p.stderr.strip().splitlines() or [""])[-1]
                report(name, True,
                       f"{len(kf_tokens)} tokens identical to transformers; {stats}")
                continue
            first = next((i for i, (a, b) in enumerate(zip(kf_tokens, hf_tokens)) if a != b),
                         min(len(kf_tokens), len(hf_tokens)))
            gap = top2_gap(model, prompt + hf_tokens[:first]) if first < len(hf_tokens) else float("nan")
            near_tie = gap < args.tie_gap
            report(name, near_tie,
                   f"first difference at new token {first} (kernelforge {kf_tokens[first:first + 3]}, "
                   f"transformers {hf_tokens[first:first + 3]}); transformers' top-2 logit gap there "
                   f"{gap:.2e}{' (a near-tie: accepted)' if near_tie else ''}; "
                   f"lengths {len(kf_tokens)} vs {len(hf_tokens)}")
        if "cuda" in devices and torch.cuda.is_available():
            half_parity(args, model, mdir, ids, prompt, tmp, want, report, dtypes)
    missed = results.count(False)
    print(f"{len(results) - missed}/{len(results)} checks passed")
    return 1 if missed else 0


HALF_TORCH = {"bf16": torch.bfloat16, "f16": torch.float16}


def half_parity(args, model, mdir, ids, prompt, tmp, want_f32, report, dtypes):
    """16-bit storage against transformers in the same dtype on the GPU."""
    greedy_tokens = 16
    for dtype, torch_dtype in HALF_TORCH.items():
        if dtype not in dtypes:
            continue
        peer = GPT2LMHeadModel.from_pretrained(mdir, torch_dtype=torch_dtype).cuda().eval()
        with torch.no_grad():
            want = peer(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
        out = os.path.join(tmp, f"logits-{dtype}.npy")
        run_kf(args.binary, ["forward", "--model", mdir, "--device", "cuda", "--dtype", dtype,
                             "--ids", ",".join(map(str, ids)), "--logits-out", out])
        got = np.load(out)
        e = rel_l2(got, want)
        report(f"forward cuda --dtype {dtype}", e < 2e-2,
               f"relative L2 {e:.3e} against transformers {dtype} (target < 2e-2); against f32 "
               f"transformers: ours {rel_l2(got, want_f32):.3e}, transformers {dtype} {rel_l2(want, want_f32):.3e}")
        if dtype != "bf16":
            continue
        with torch.no_grad():
            hf = peer.generate(torch.tensor([prompt], device="cuda"), do_sample=False,
                               max_new_tokens=greedy_tokens, pad_token_id=50256,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"))
        hf_tokens = hf[0, len(prompt):].tolist()
        p = run_kf(args.binary, ["generate", "--model", mdir, "--device", "cuda", "--dtype", dtype,
                                 "--ids", ",".join(map(str, prompt)), "--greedy",
                                 "--max-new-tokens", str(greedy_tokens), "--print-ids"])
        lines = [l for l in p.stdout.strip().splitlines() if l.strip()]
        kf_tokens = [int(x) for x in lines[-1].split(",")] if lines else []
        first = next((i for i, (a, b) in enumerate(zip(kf_tokens, hf_tokens)) if a != b),
                     min(len(kf_tokens), len(hf_tokens)))
        report(f"greedy generate cuda --dtype {dtype}", kf_tokens == hf_tokens,
               f"{first} of {greedy_tokens} tokens identical to transformers {dtype}"
               + ("" if kf_tokens == hf_tokens else
                  f" (kernelforge {kf_tokens[first:first + 3]}, transformers {hf_tokens[first:first + 3]})"))
        del peer
        torch.cuda.empty_cache()


def cuda_time(fn, repeats):
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def hf_throughput(model, batch, seq, steps, repeats):
    dev = "cuda"
    rng = np.random.default_rng(0)
    ids = torch.tensor(rng.integers(0, 50257, size=(batch, seq)), device=dev)
    out = {}
    with torch.no_grad():
        model(ids)  # warm-up
        t = cuda_time(lambda: model(ids), repeats)
        out["forward_tokens_per_s"] = batch * seq / t
        prefill = min(seq, model.config.n_positions - steps)

        def decode():
            o = model(ids[:, :prefill], use_cache=True)
            past = o.past_key_values
            nxt = o.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                o = model(nxt, past_key_values=past, use_cache=True)
                past = o.past_key_values
                nxt = o.logits[:, -1].argmax(-1, keepdim=True)
            nxt.cpu()
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        decode()  # warm-up
        dt = sorted(decode() for _ in range(3))[1]
        out["decode_tokens_per_s"] = batch * steps / dt
    return out


def make_static_cache(model, batch, max_len):
    """A transformers StaticCache for `batch` sequences of `max_len` tokens, or (None, why).
    Its constructor changed across versions: the keyword sets are tried newest-compatible first."""
    try:
        from transformers import StaticCache
    except ImportError:
        import transformers
        return None, f"transformers {transformers.__version__} has no StaticCache (it came in 4.38): peer skipped"
    cfg, dev, dt = model.config, model.device, model.dtype
    tries = [dict(config=cfg, max_batch_size=batch, max_cache_len=max_len, device=dev, dtype=dt),
             dict(config=cfg, max_cache_len=max_len),  # newer versions size and place it on first use
             dict(config=cfg, batch_size=batch, max_cache_len=max_len, device=dev, dtype=dt)]
    errors = []
    for kwargs in tries:
        try:
            return StaticCache(**kwargs), None
        except TypeError as e:
            errors.append(str(e))
    return None, "no StaticCache constructor signature fits: " + "; ".join(errors)


def sample_in_graph(logits, sampling):
    """The next token of each row of `logits` [B, V] by temperature, top-k and top-p, with no host
    synchronisation (so that it can be captured in a CUDA graph): top-k by torch.topk, top-p as
    transformers' TopPLogitsWarper does it (sort, cumulative softmax, mask), then one draw per row
    by the exponential race (argmax of p / Exp(1) noise, gpt-fast's sync-free multinomial)."""
    temperature, top_k, top_p = sampling
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[:, -1] = False  # keep at least one token
        remove = remove_sorted.scatter(1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    probs = logits.softmax(dim=-1)
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1, keepdim=True)


def hf_static_graph_decode(model, batch, prefill, steps, repeats, sampling=None):
    """Decode tokens/s of `model` (bf16, on the GPU) with a static KV cache and the whole decode
    step captured in one CUDA graph, greedy or (`sampling` = (temperature, top_k, top_p)) sampled
    inside the graph; returns (tokens_per_s, None) or (None, why).

    The step reads its token and position from static buffers and writes the next token and
    position back into them, so a timed run is `steps` graph replays and nothing else."""
    dev = "cuda"
    cache, why = make_static_cache(model, batch, prefill + steps)
    if cache is None:
        return None, why
    rng = np.random.default_rng(1)
    ids = torch.tensor(rng.integers(0, 50257, size=(batch, prefill)), device=dev)
    # Where the cache writes: transformers 4.x passes `cache_position` down to the cache; 5.x has
    # no such argument, each cache layer counts its tokens in a device tensor instead.
    takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters
    with torch.no_grad():
        try:
            extra = {"cache_position": torch.arange(prefill, device=dev)} if takes_cache_position else {}
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, **extra)
        except Exception as e:  # an older GPT-2 that only takes tuples of tensors
            return None, f"this transformers' GPT-2 does not run with a StaticCache: {type(e).__name__}: {e}"
        counters = [layer.cumulative_length for layer in getattr(cache, "layers", [])
                    if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
        first = out.logits[:, -1].argmax(-1, keepdim=True)
        static_ids = first.clone()
        static_pos = torch.full((1,), prefill, dtype=torch.long, device=dev)

        def rewind():
            """Back to just after the prefill: the first token, its position, the cache counters."""
            static_ids.copy_(first)
            static_pos.fill_(prefill)
            for c in counters:
                c.fill_(prefill)

        def step():
            extra = {"cache_position": static_pos} if takes_cache_position else {}
            o = model(input_ids=static_ids, past_key_values=cache, use_cache=True,
                      position_ids=static_pos.view(1, 1).expand(batch, 1), **extra)
            last = o.logits[:, -1]
            static_ids.copy_(last.argmax(-1, keepdim=True) if sampling is None else sample_in_graph(last, sampling))
            static_pos.add_(1)

        graph = torch.cuda.CUDAGraph()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture stream, as PyTorch asks
                for _ in range(min(3, steps)):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            rewind()
            with torch.cuda.graph(graph):
                step()
        except Exception as e:
            return None, f"capturing the static-cache decode step in a CUDA graph failed: {type(e).__name__}: {e}"

        def timed():
            rewind()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                graph.replay()
            static_ids.cpu()  # the last tokens reach the host (kernelforge copies B ids back every step)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        timed()  # warm-up
        dt = sorted(timed() for _ in range(max(1, repeats)))[max(1, repeats) // 2]
    return batch * steps / dt, None


def parse_batches(text):
    """`1,8,32` as a list of positive ints; exits with a message naming the bad value."""
    try:
        batches = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--peer-batches {text}: give batch sizes such as 1,8,32")
    if not batches or min(batches) < 1 or len(set(batches)) != len(batches):
        raise SystemExit(f"--peer-batches {text}: sizes must be at least 1 and listed once, such as 1,8,32")
    return batches


def kf_batches(args, mdir, engine, batches, flags):
    """`kernelforge bench --batch LIST --decode-engine ENGINE --json`, one run for every batch:
    {batch: (decode entry, None) or (None, why)}. A batch kernelforge refuses on the engine has
    its reason; a run that fails as a whole (a batch that does not fit, an engine this build
    cannot run) gives every batch the last line of its stderr."""
    p = run_kf(args.binary, ["bench", "--model", mdir, "--device", "cuda", "--dtype", "bf16",
                             "--batch", ",".join(map(str, batches)), "--seq", str(args.seq),
                             "--generate", str(args.steps), "--repeats", "1", "--decode-engine", engine,
                             "--json"] + flags, check=False)
    if p.returncode != 0:
        why = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        return {b: (None, why) for b in batches}
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    # One batch prints the one-batch document (its `decode` object), a list a `batches` array.
    entries = doc.get("batches") or [dict(doc["decode"], batch=doc["batch"])]
    out = {b: (None, "not in kernelforge's output") for b in batches}
    for e in entries:
        out[e["batch"]] = (None, e["error"]) if e.get("error") else (e, None)
    return out


def floor_words(d):
    """`23% of the floor (0.090 ms a step, memory-bound)` from a decode entry, or None."""
    memory, compute = d.get("floor_ms"), d.get("compute_floor_ms")
    floor = max(x for x in (memory, compute, 0.0) if x is not None)
    step = d.get("gpu_ms_per_step") or d.get("ms_per_step")
    if not floor or not step:
        return None
    bound = d.get("floor_bound") or "memory"
    return f"{100 * floor / step:.0f}% of the floor ({floor:.3f} ms a step, {bound}-bound)"


def static_peer(args, mdir):
    """The static-cache CUDA-graph transformers peer beside kernelforge bf16 decode (graph and
    megakernel engines) at every batch of --peer-batches, greedy and sampled (--peer-sampling):
    prints a table each, a column per batch (n/a where a side cannot run it, the reasons below)."""
    prefill = min(args.seq, 1024 - args.steps)
    batches = parse_batches(args.peer_batches)
    sampling = tuple(float(x) for x in args.peer_sampling.split(","))
    sampling = (sampling[0], int(sampling[1]), sampling[2])
    peer = GPT2LMHeadModel.from_pretrained(mdir, torch_dtype=torch.bfloat16).cuda().eval()
    runs = [("greedy", None, []),
            (f"sampled (temperature {sampling[0]}, top-k {sampling[1]}, top-p {sampling[2]})", sampling,
             ["--temperature", str(sampling[0]), "--top-k", str(sampling[1]), "--top-p", str(sampling[2])])]
    hf = {}
    for name, how, _ in runs:
        for b in batches:
            try:
                hf[name, b] = hf_static_graph_decode(peer, b, prefill, args.steps, args.repeats, how)
            except torch.cuda.OutOfMemoryError as e:
                hf[name, b] = (None, f"out of GPU memory: {str(e).splitlines()[0]}")
            torch.cuda.empty_cache()
    del peer
    torch.cuda.empty_cache()
    label = 48
    cell = lambda text: f"{text:>10}"
    for name, _, flags in runs:
        print(f"\nbf16 {name} decode, {args.steps} steps after a {prefill}-token prompt, tokens/s")
        print(f"{'':<{label}} " + " ".join(cell(f"batch {b}") for b in batches))
        peer_row = [cell(f"{hf[name, b][0]:.0f}" if hf[name, b][0] else "n/a") for b in batches]
        print(f"{'transformers StaticCache + CUDA graph':<{label}} " + " ".join(peer_row))
        for b in batches:
            if hf[name, b][1]:
                print(f"  batch {b}: {hf[name, b][1]}")
        for engine in ("graph", "megakernel"):
            kf = kf_batches(args, mdir, engine, batches, flags)
            cells, ratios, why = [], [], []
            reasons = {refused for _, refused in kf.values()}
            if len(batches) > 1 and all(d is None for d, _ in kf.values()) and len(reasons) == 1:
                why.append(f"every batch: n/a: {reasons.pop()}")  # the run failed as a whole
                kf = {b: (None, None) for b in batches}
            for b in batches:
                d, refused = kf[b]
                if d is None:
                    cells.append(cell("n/a"))
                    ratios.append(cell(""))
                    if refused:
                        why.append(f"batch {b}: n/a: {refused}")
                    continue
                if d.get("prefill_tokens") != prefill:
                    why.append(f"batch {b}: kernelforge prefilled {d.get('prefill_tokens')} tokens, not {prefill}")
                ran = d.get("engine")
                if ran and ran != engine:
                    why.append(f"batch {b}: ran on the {ran} engine (more sequences than the megakernel holds)")
                tps = d["tokens_per_s"]
                cells.append(cell(f"{tps:.0f}"))
                ratios.append(cell(f"{tps / hf[name, b][0]:.2f}x") if hf[name, b][0] else cell(""))
                reached = floor_words(d)
                if reached:
                    why.append(f"batch {b}: {reached}")
            print(f"{'kernelforge --decode-engine ' + engine:<{label}} " + " ".join(cells))
            print((f"{'  ratio to transformers':<{label}} " + " ".join(ratios)).rstrip())
            for w in why:
                print(f"  {w}")
    return 0


def throughput(args):
    if not torch.cuda.is_available():
        print("--size gpt2 needs a CUDA GPU for transformers", file=sys.stderr)
        return 1
    model = build_model(12, 12, 768, 1024, args.seed, args.noise)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        mdir = os.path.join(tmp, "gpt2-random")
        model.save_pretrained(mdir, safe_serialization=True)
        if args.static_peer == "only":
            return static_peer(args, mdir)
        # Each kernelforge dtype against transformers in the same precision (tf32: f32 tensors
        # with TF32 matmuls allowed), attention as --hf-attention says (SDPA by default).
        runs = [(8, [], "f32"), (8, ["--dtype", "tf32"], "tf32"), (8, ["--dtype", "bf16"], "bf16"),
                (8, ["--dtype", "f16"], "fp16"), (1, [], "f32"), (1, ["--dtype", "bf16"], "bf16")]
        if args.unfused:
            runs += [(8, ["--unfused"], "f32"), (1, ["--unfused"], "f32")]
        wanted = set(args.dtypes.split(","))
        runs = [r for r in runs if (r[1][1] if r[1][:1] == ["--dtype"] else "f32") in wanted]
        hf = {}
        for peer in ("f32", "tf32", "bf16", "fp16"):
            if not any(r[2] == peer for r in runs):
                continue
            torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(peer, torch.float32)
            try:
                m = GPT2LMHeadModel.from_pretrained(mdir, attn_implementation=args.hf_attention,
                                                    torch_dtype=torch_dtype)
            except TypeError:
                m = GPT2LMHeadModel.from_pretrained(mdir, torch_dtype=torch_dtype)
            m = m.cuda().eval()
            torch.backends.cuda.matmul.allow_tf32 = peer == "tf32"
            hf.update({(peer, b): hf_throughput(m, b, args.seq, args.steps, args.repeats) for b in (1, 8)})
            torch.backends.cuda.matmul.allow_tf32 = False
            del m
            torch.cuda.empty_cache()
        print(f"transformers peer: attention {args.hf_attention}, same precision as each kernelforge dtype", flush=True)
        for b, extra, peer in runs:
            p = run_kf(args.binary, ["bench", "--model", mdir, "--device", "cuda", "--batch", str(b),
                                     "--seq", str(args.seq), "--generate", str(args.steps),
                                     "--repeats", str(args.repeats), "--json"] + extra)
            kf = json.loads(p.stdout.strip().splitlines()[-1])
            name = f"batch {b}{' ' + ' '.join(extra).replace('--', '') if extra else ''}"
            rows.append((f"forward {name} x {args.seq}", kf["forward"]["tokens_per_s"], peer,
                         hf[(peer, b)]["forward_tokens_per_s"]))
            rows.append((f"decode {name} ({args.steps} steps)", kf["decode"]["tokens_per_s"], peer,
                         hf[(peer, b)]["decode_tokens_per_s"]))
            tk = kf.get("tuned_kernels") or {}
            print(f"kernelforge {name}: {tk.get('tuned', '?')}/{tk.get('total', '?')} kernels tuned; "
                  f"top kernels: " + ", ".join(
                      f"{r['role']} {r['kernel']} {r['percent']:.0f}%" for r in kf["profile"]["forward"][:4]),
                  flush=True)
        print(f"\n{'tokens/s':<36} {'kernelforge':>12} {'transformers':>13} {'peer':>5} {'ratio':>7}")
        for name, k, peer, h in rows:
            print(f"{name:<36} {k:>12.0f} {h:>13.0f} {peer:>5} {k / h:>7.2f}")
        if args.static_peer == "yes":
            static_peer(args, mdir)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary", help="path of the kernelforge binary")
    ap.add_argument("--size", choices=["small", "gpt2"], default="small")
    ap.add_argument("--layers", type=int, default=3, help="parity model depth (2..4 is plenty)")
    ap.add_argument("--tokens", type=int, default=77, help="forward length for the logits check")
    ap.add_argument("--prompt-tokens", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--noise", type=float, default=0.1, help="std of the bias/LayerNorm perturbation")
    ap.add_argument("--tie-gap", type=float, default=1e-4,
                    help="a greedy mismatch where transformers' top-2 logits are closer than this is accepted")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-only", action="store_true", help="skip the cuda checks")
    ap.add_argument("--seq", type=int, default=1024, help="throughput: forward length")
    ap.add_argument("--steps", type=int, default=64, help="throughput: decode steps")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--unfused", action="store_true", help="throughput: also bench kernelforge --unfused")
    ap.add_argument("--peer-batches", default="1,8", metavar="B,B,...",
                    help="the static-peer tables' batches: the peer and kernelforge (one `bench --batch LIST` "
                         "run per engine) at each, e.g. 1,8,32,64,128,256")
    ap.add_argument("--peer-sampling", default="0.8,40,0.95", metavar="T,K,P",
                    help="the sampled static-peer table's temperature, top-k and top-p")
    ap.add_argument("--static-peer", choices=["yes", "no", "only"], default="yes",
                    help="throughput: also (or only) compare bf16 decode with transformers' static cache + CUDA graph")
    ap.add_argument("--hf-attention", choices=["sdpa", "eager"], default="sdpa",
                    help="throughput: transformers' attention implementation for the peer")
    ap.add_argument("--dtypes", default="f32,tf32,bf16,f16",
                    help="the kernelforge dtypes to check (parity: f32 always) or to bench (throughput), comma-separated")
    args = ap.parse_args()
    args.binary = os.path.abspath(args.binary)
    parse_batches(args.peer_batches)  # a bad list is refused before any model is built
    sys.exit(parity(args) if args.size == "small" else throughput(args))


if __name__ == "__main__":
    main()
