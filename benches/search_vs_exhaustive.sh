#!/usr/bin/env bash
# How close the tuner's search comes to `--exhaustive`, in one device call. For each workload:
# SEARCHES cold `tune --op` searches, then one `--exhaustive` run, each with its own empty
# database and compile cache. Prints, per run, the winner's time, its speed against the peer,
# the tuning time and the winner's point, and how far each search's winner is from the
# exhaustive one.
#
# FAMILY=NAME (default matmul_wgmma_tma) restricts the exhaustive run to that family: a project
# folder holding only its spec (and every template) is made for it. The search always runs over
# every family. FAMILY=all makes the exhaustive run cover every family too. That takes longer
# than a device call for most GPT-2 shapes: fc at M = 8192 in bf16 is 7,346 variants, 305 s on
# an H100, 173 s of it verification.
#
#   [OP=matmul] [WORKLOADS="dtype:shape:epilogue ..."] [SEARCHES=1] [FAMILY=matmul_wgmma_tma|all] \
#     [LIMIT=300] benches/search_vs_exhaustive.sh
#
# OP=attention_decode (or any op without epilogues) takes workloads as "dtype:shape:" and
# FAMILY=all; the decode-attention fixtures (batch 32-256 after 128-1,024 tokens, H200) came from
#   OP=attention_decode FAMILY=all WORKLOADS="bf16:B=32,HS=64,NH=12,T=512,max_T=512: ..."
#
# The default workloads are GPT-2 small's bf16 GEMMs at M = 8192, the LM head left out: its
# family's exhaustive run does not fit LIMIT, since at 1 ms a call every variant is also
# verified. Run it on the GPU machine after ../shared/tools/device-pack (the binary in .device/).
# Logs go to $OUT/r; the JSON of every run is there too, and for each workload a fixture of the
# exhaustive run's screen times for tests/search_replay.rs (fixture-*.txt: the timed points of
# its two fastest families, in tests/fixtures/search_replay/'s format; write its header by hand).
set -uo pipefail
out=${OUT:-/tmp}/r
mkdir -p "$out"
kf=${KF:-.device/kernelforge}
op=${OP:-matmul}
family=${FAMILY:-matmul_wgmma_tma}
limit=${LIMIT:-300}
workloads=${WORKLOADS:-bf16:8192,3072,768:bias_gelu bf16:M=8192,N=2304,K=768,T=1024,n_head=12:qkv bf16:8192,768,768:bias_residual bf16:8192,768,3072:bias_residual}
root=.
if [ "$family" != all ]; then
  [ -f "specs/$family.toml" ] || { echo "FAMILY=$family: no specs/$family.toml" >&2; exit 2; }
  root=$(mktemp -d)
  mkdir -p "$root/specs" && cp "specs/$family.toml" "$root/specs/" && cp -r templates "$root/"
fi
# The winner of one run's JSON: ms, speed vs the peer, tuning seconds, point ("-" when none).
summary() {
  python3 - "$1" <<'PY'
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
    w = doc["results"][0]["winner"]
    peer = w.get("baseline_ms")
    speed = f"{peer / w['median_ms']:.2f}x" if peer else "-"
    point = " ".join(f"{k}={v}" for k, v in w["params"].items())
    print(f"{w['median_ms']:.4f} {speed} {doc['seconds']:.1f} {w['family']} {point}")
except Exception as e:  # a run that failed or ran out of time
    print(f"- - - ({type(e).__name__})")
PY
}
# One cold run of the current workload ($dtype, $shape, $epilogue, $tag): run NAME [FLAGS...].
run() {
  local log="$out/$1-$tag"
  KERNELFORGE_CACHE="/tmp/kf-sve-$1-$tag" timeout "$limit" "$kf" tune --op "$op" --shape "$shape" \
    ${epilogue:+--epilogue "$epilogue"} --dtype "$dtype" --force --json "${@:2}" > "$log.json" 2> "$log.err"
  summary "$log.json"
}
# The exhaustive run's JSON as a replay fixture: `family I NAME PARAMS...`, then `I VALUES MS`.
fixture() {
  python3 - "$1" "$2" <<'PY'
import json, sys
try:
    tried = json.load(open(sys.argv[1]))["results"][0]["tried"]
except Exception:
    sys.exit(0)
rows = {}
for t in tried:
    if t.get("median_ms") is None:
        continue
    pairs = [p.split("=") for p in t["variant"].split() if not p.startswith(("dtype=", "epilogue=", "mask="))]
    rows.setdefault(t["family"], ([k for k, _ in pairs], []))[1].append(([v for _, v in pairs], t["median_ms"]))
best = {f: min(ms for _, ms in r[1]) for f, r in rows.items()}
top = sorted(best, key=best.get)[:2]
with open(sys.argv[2], "w") as out:
    out.write("# (say here what recorded it: the command, the GPU, the CUDA version)\n")
    for i, f in enumerate(top):
        out.write(f"family {i} {f} {' '.join(rows[f][0])}\n")
    for i, f in enumerate(top):
        for values, ms in sorted(rows[f][1], key=lambda r: r[1]):
            out.write(f"{i} {','.join(values)} {ms:.5f}\n")
PY
}
for w in $workloads; do
  IFS=: read -r dtype shape epilogue <<< "$w"
  tag="$dtype-$(tr ',=' '__' <<< "$shape")-$epilogue"
  echo "== $w"
  rm -rf /tmp/kf-sve-*-"$tag"
  searches=()
  for i in $(seq "${SEARCHES:-1}"); do
    line=$(run "search$i")
    searches+=("$line")
    read -r ms speed secs fam point <<< "$line"
    printf '  search %d:   %s ms, %s, %s s, %s %s\n' "$i" "$ms" "$speed" "$secs" "$fam" "$point"
  done
  line=$(run exhaustive --exhaustive --root "$root")
  read -r best speed secs fam point <<< "$line"
  printf '  exhaustive: %s ms, %s, %s s, %s %s (%s)\n' "$best" "$speed" "$secs" "$fam" "$point" "$family"
  fixture "$out/exhaustive-$tag.json" "$out/fixture-$tag.txt"
  for i in "${!searches[@]}"; do
    read -r ms _ <<< "${searches[$i]}"
    python3 -c "import sys; a, b, i = sys.argv[1:]; print(f'  search {int(i) + 1} is {100 * (float(a) / float(b) - 1):+.1f}% from the exhaustive winner')" \
      "$ms" "$best" "$i" 2>/dev/null || echo "  search $((i + 1)): no comparison (a run failed or ran out of time; logs in $out)"
  done
done
tar czf "${OUT:-/tmp}/results.tgz" -C "${OUT:-/tmp}" r
