//! `kernelforge tokenize`, `forward`, `generate` and `bench`: thin commands over
//! [`crate::model`], implementing the DESIGN.md command-line contract. Text goes to stdout
//! (streamed token by token for `generate`), one stats line goes to stderr at the end, `--json`
//! prints one JSON object instead. `--device` defaults to `cuda` when a GPU opens, else `cpu`.
//!
//! This file holds what the commands share (the model arguments, device choice, building a
//! backend); each command has its own file.

mod batch_list;
mod bench;
mod bench_batches;
mod bench_batches_report;
mod bench_decode;
mod bench_setup;
mod fits;
mod forward;
mod generate;
mod sampling;
mod tokenize;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::gpu::{DeviceListError, DeviceSelection};
use crate::model::cpu::CpuBackend;
use crate::model::engine::{DecodeEngine, UnknownEngine};
use crate::model::generate::Backend;
use crate::model::hub::HubSettings;
use crate::model::replicas::{ReplicaOptions, Replicas};
use crate::model::tokenizer::Tokenizer;
use crate::model::weights::{load_model, GPT2Model};
use crate::spec::Dtype;

pub use batch_list::{BatchList, BatchListError};
pub use bench::{run_bench, BenchArgs};
pub use forward::{run_forward, ForwardArgs};
pub use generate::{run_generate, GenerateArgs};
pub use tokenize::{run_tokenize, TokenizeArgs};

/// Where the forward pass runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda,
}

impl Device {
    pub fn as_str(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

/// The `--decode-engine` help of `generate` and `bench`.
const DECODE_ENGINE_HELP: &str = "How decode steps run on the GPU (default: the one `tune --decode-step` \
found fastest for this GPU, model, dtype and batch, else graph). \
launches: one kernel launch per op (profilable kernel by kernel); \
graph: the step recorded once as a CUDA graph and replayed with one launch; \
megakernel: one persistent kernel runs the whole step (blocks pull tasks in order, \
streaming the next weights while they wait) for batches of up to 16 sequences in f16/bf16 \
(tensor cores, sm_80 on) and 8 in f32; a larger batch runs on the graph engine, with a note";

fn parse_engine(s: &str) -> Result<DecodeEngine, UnknownEngine> {
    s.parse()
}

/// `--decode-engine` checked against the device: on the GPU the engine asked for (`None`: the
/// backend's choice, the tuned engine else the graph); on the CPU none (asking for one there is
/// an error naming the fix).
pub fn decode_engine_for(device: Device, asked: Option<DecodeEngine>) -> Result<Option<DecodeEngine>> {
    match (device, asked) {
        (Device::Cpu, Some(e)) => bail!(
            "--decode-engine {e}: decode engines are GPU paths (the CPU backend has one way to decode); \
             drop --decode-engine or pass --device cuda"
        ),
        (Device::Cpu, None) => Ok(None),
        (Device::Cuda, e) => Ok(e),
    }
}

/// The `--decode-engine` argument of `generate` and `bench`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct EngineArgs {
    #[arg(long, value_name = "launches|graph|megakernel", value_parser = parse_engine, help = DECODE_ENGINE_HELP)]
    pub decode_engine: Option<DecodeEngine>,
}

/// What every model command shares: the checkpoint, where to run it, and which kernels.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a Hugging Face folder, an llm.c .bin checkpoint, or a size name
    /// (gpt2, gpt2-medium, gpt2-large, gpt2-xl): taken from the Hugging Face cache, else
    /// downloaded from the hub into it (not with HF_HUB_OFFLINE=1).
    #[arg(long, value_name = "DIR|FILE|NAME")]
    pub model: String,
    /// Where to run (default: cuda when a GPU opens, else cpu).
    #[arg(long, value_enum)]
    pub device: Option<Device>,
    /// GPU: the unfused baseline (separate bias, GELU and residual kernels, naive attention).
    #[arg(long)]
    pub unfused: bool,
    /// GPUs to run on (GPU only): indices such as 0,1, or `all` (default: GPU 0). Each GPU
    /// holds a replica of the model, loaded once; a batch is cut into one slice per GPU
    /// (equal slices on equal GPUs, in proportion to their SM counts otherwise), the slices run
    /// at once and the results come back in sequence order, identical to one GPU's. A batch
    /// smaller than the list uses only as many GPUs as it has sequences.
    #[arg(long, value_name = "LIST|all", value_parser = parse_devices)]
    pub devices: Option<DeviceSelection>,
    /// Precision. f32: everything in f32 (the CPU's only mode). GPU only: tf32 = f32 storage,
    /// the compute-bound matmuls and the prefill's attention on tensor cores with inputs rounded
    /// to TF32; f16 / bf16 =
    /// weights (converted once at load), activations and KV cache stored in 16 bits, matmuls
    /// and attention on tensor cores, f32 math and accumulation inside every kernel.
    #[arg(long, default_value = "f32", value_parser = crate::cli::kernels::parse_dtype)]
    pub dtype: Dtype,
    /// The project folder (specs/, templates/) from the global --root.
    #[arg(skip)]
    pub root: Option<PathBuf>,
}

impl ModelArgs {
    /// The device to run on, checked against --dtype and --unfused.
    pub(crate) fn device(&self) -> Result<Device> {
        let device = resolve_device(self.device);
        check_device(device, self.dtype, self.unfused)?;
        if let (Device::Cpu, Some(d)) = (device, &self.devices) {
            bail!("--devices {d} picks GPUs; the CPU backend runs on the host (drop --devices or pass --device cuda)");
        }
        Ok(device)
    }

    /// Backend options for buffers sized to `max_batch` sequences.
    pub(crate) fn backend_options(&self, max_batch: usize) -> BackendOptions {
        BackendOptions {
            max_batch,
            unfused: self.unfused,
            dtype: self.dtype,
            root: self.root.clone(),
            decode_engine: None,
            devices: self.devices.clone().unwrap_or_default(),
        }
    }
}

pub(crate) fn parse_devices(s: &str) -> Result<DeviceSelection, DeviceListError> {
    s.parse()
}

/// Parse `15496,11,995` (commas and/or whitespace) into token ids.
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let ids = s
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.parse::<u32>()
                .with_context(|| format!("`{x}` in the id list is not a token id (expected e.g. 15496,11,995)"))
        })
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("the id list `{s}` is empty");
    }
    Ok(ids)
}

pub(crate) fn join_ids(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// Turn `--model` into a path: an existing path as is; a size name (gpt2, gpt2-medium,
/// gpt2-large, gpt2-xl) from the Hugging Face cache, else downloaded from the hub when online
/// (see [`crate::model::hub`]).
pub fn resolve_model(spec: &str) -> Result<PathBuf> {
    Ok(crate::model::hub::resolve_model(spec, &HubSettings::from_env())?)
}

/// `--device` as given, or `cuda` when the driver is there and GPU 0 opens, else `cpu`.
pub fn resolve_device(device: Option<Device>) -> Device {
    match device {
        Some(d) => d,
        None if crate::gpu::device::driver_present() && crate::gpu::Gpu::new(0).is_ok() => Device::Cuda,
        None => Device::Cpu,
    }
}

pub(crate) fn check_device(device: Device, dtype: Dtype, unfused: bool) -> Result<()> {
    match device {
        Device::Cuda if !crate::gpu::device::driver_present() => bail!(
            "--device cuda: no CUDA driver found (libcuda.so); this needs an NVIDIA GPU with its driver installed, \
             or pass --device cpu"
        ),
        Device::Cuda => Ok(()),
        Device::Cpu if dtype != Dtype::F32 => {
            bail!("--dtype {dtype}: the CPU backend computes in f32 only; drop --dtype or pass --dtype f32 (or --device cuda)")
        }
        Device::Cpu if unfused => bail!("--unfused selects the GPU baseline kernels; it needs --device cuda"),
        Device::Cpu => Ok(()),
    }
}

pub(crate) fn load(spec: &str) -> Result<Arc<GPT2Model>> {
    let path = resolve_model(spec)?;
    let model = load_model(&path).with_context(|| format!("loading model {}", path.display()))?;
    Ok(Arc::new(model))
}

/// How to build a backend beyond the device.
#[derive(Clone, Debug, Default)]
pub struct BackendOptions {
    /// Sequences the GPU buffers are sized for up front (they grow if a larger batch comes).
    pub max_batch: usize,
    /// GPU: the unfused baseline kernels.
    pub unfused: bool,
    /// GPU: the precision (see [`ModelArgs::dtype`]).
    pub dtype: Dtype,
    /// The project folder with specs/ and templates/ (default: [`crate::cli::project_root`]).
    pub root: Option<PathBuf>,
    /// GPU: how decode steps run (`None`: the backend's default, [`DecodeEngine::Graph`]).
    pub decode_engine: Option<DecodeEngine>,
    /// GPU: the GPUs to run on (default: GPU 0).
    pub devices: DeviceSelection,
}

/// The GPUs a batch of `max_batch` sequences runs on: `asked` resolved against this machine,
/// cut to one GPU per sequence when the batch is smaller (with a note saying so).
pub fn gpus_for_batch(asked: &DeviceSelection, count: usize, max_batch: usize) -> Result<(Vec<usize>, Option<String>)> {
    let mut devices = asked.resolve(count)?;
    let max_batch = max_batch.max(1);
    if devices.len() <= max_batch {
        return Ok((devices, None));
    }
    devices.truncate(max_batch);
    let used: Vec<String> = devices.iter().map(|d| format!("cuda:{d}")).collect();
    let note = format!(
        "a batch of {max_batch} runs on {} of the {} GPUs asked for ({}): a sequence is never split across GPUs; \
         raise --batch to use them all",
        devices.len(),
        asked.resolve(count)?.len(),
        used.join(", ")
    );
    Ok((devices, Some(note)))
}

/// Build the GPU backend: a replica on each GPU of `opts.devices` (weights uploaded, buffers
/// allocated for its slice of `opts.max_batch` sequences), decode steps on
/// `opts.decode_engine` (an error when this build or GPU cannot run it).
pub fn make_gpu_backend(model: Arc<GPT2Model>, opts: &BackendOptions) -> Result<Replicas> {
    let root = crate::cli::project_root(opts.root.as_deref())?;
    let (devices, note) = gpus_for_batch(&opts.devices, crate::gpu::device_count()?, opts.max_batch)?;
    if let Some(n) = note {
        eprintln!("note: {n}");
    }
    let replica = ReplicaOptions {
        max_batch: opts.max_batch.max(1),
        unfused: opts.unfused,
        dtype: opts.dtype,
        decode_engine: opts.decode_engine,
    };
    let mut gpus = Replicas::open(&root, &devices, model, &replica)?;
    for n in gpus.notes()? {
        eprintln!("note: {n}");
    }
    Ok(gpus)
}

/// Build the backend for `device`.
pub fn make_backend(
    device: Device,
    dtype: Dtype,
    model: Arc<GPT2Model>,
    opts: &BackendOptions,
) -> Result<Box<dyn Backend>> {
    check_device(device, dtype, opts.unfused)?;
    decode_engine_for(device, opts.decode_engine)?;
    Ok(match device {
        Device::Cpu => Box::new(CpuBackend::new(model)),
        Device::Cuda => Box::new(make_gpu_backend(model, opts)?),
    })
}

pub(crate) fn prompt_ids(tok: &Tokenizer, ids: &Option<String>, prompt: &Option<String>) -> Result<Vec<u32>> {
    match (ids, prompt) {
        (Some(ids), _) => parse_ids(ids),
        (None, Some(text)) => {
            let ids = tok.encode(text);
            if ids.is_empty() {
                bail!("the prompt is empty: GPT-2 needs at least one token (try --ids 50256)");
            }
            Ok(ids)
        }
        (None, None) => bail!("give --prompt TEXT or --ids IDS"),
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::model::config::GPT2Config;
    use crate::model::npy::read_npy_f32;
    use crate::model::weights::{write_hf_folder, write_llmc, GPT2Weights, LlmcVersion};

    #[test]
    fn id_lists() {
        assert_eq!(parse_ids("15496,11, 995").unwrap(), vec![15496, 11, 995]);
        assert_eq!(parse_ids("1 2\t3").unwrap(), vec![1, 2, 3]);
        assert!(parse_ids("1,x").unwrap_err().to_string().contains("`x`"));
        assert!(parse_ids(" , ").is_err());
    }

    #[test]
    fn dtypes_each_device_cannot_run_are_refused_with_the_fix() {
        for dtype in [Dtype::Tf32, Dtype::F16, Dtype::Bf16] {
            let e = check_device(Device::Cpu, dtype, false).unwrap_err().to_string();
            assert!(
                e.contains("f32 only") && e.contains("--dtype f32") && e.contains(dtype.as_str()),
                "{e}"
            );
        }
        assert!(check_device(Device::Cpu, Dtype::F32, false).is_ok());
    }

    #[test]
    fn decode_engines_parse_default_to_graph_and_are_refused_on_the_cpu() {
        use clap::Parser;
        let parse = |args: &[&str]| crate::cli::Cli::try_parse_from(args.iter().copied());
        for (cmd, e) in [("generate", "megakernel"), ("bench", "launches"), ("bench", "graph")] {
            let ids: &[&str] = if cmd == "generate" { &["--ids", "1"] } else { &[] };
            let args = [&["kernelforge", cmd, "--model", "gpt2", "--decode-engine", e], ids].concat();
            let cli = parse(&args).unwrap();
            let asked = match cli.command {
                crate::cli::Command::Generate(a) => a.engine.decode_engine,
                crate::cli::Command::Bench(a) => a.engine.decode_engine,
                _ => unreachable!(),
            };
            assert_eq!(asked, Some(e.parse().unwrap()));
        }
        let err = parse(&["kernelforge", "bench", "--model", "gpt2", "--decode-engine", "fast"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("fast") && err.contains("launches, graph, megakernel"),
            "{err}"
        );
        // The deprecated --no-cuda-graphs still parses, but not beside --decode-engine.
        assert!(parse(&["kernelforge", "bench", "--model", "gpt2", "--no-cuda-graphs"]).is_ok());
        assert!(parse(&[
            "kernelforge",
            "bench",
            "--model",
            "gpt2",
            "--no-cuda-graphs",
            "--decode-engine",
            "graph"
        ])
        .is_err());
        let help = parse(&["kernelforge", "generate", "--help"]).unwrap_err().to_string();
        assert!(
            help.contains("--decode-engine") && help.contains("else graph"),
            "{help}"
        );
        assert_eq!(
            decode_engine_for(Device::Cuda, None).unwrap(),
            None,
            "the backend chooses"
        );
        assert_eq!(
            decode_engine_for(Device::Cuda, Some(DecodeEngine::Megakernel)).unwrap(),
            Some(DecodeEngine::Megakernel)
        );
        assert_eq!(decode_engine_for(Device::Cpu, None).unwrap(), None);
        let e = decode_engine_for(Device::Cpu, Some(DecodeEngine::Launches))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--decode-engine launches") && e.contains("--device cuda"),
            "{e}"
        );
    }

    #[test]
    fn devices_parse_on_every_model_command_and_a_small_batch_uses_fewer_gpus() {
        use clap::Parser;
        let parse = |args: &[&str]| crate::cli::Cli::try_parse_from(args.iter().copied());
        for cmd in ["forward", "generate", "bench"] {
            let ids: &[&str] = if cmd == "bench" { &[] } else { &["--ids", "1"] };
            let args = [&["kernelforge", cmd, "--model", "gpt2", "--devices", "0,1"], ids].concat();
            let target = match parse(&args).unwrap().command {
                crate::cli::Command::Forward(a) => a.target,
                crate::cli::Command::Generate(a) => a.target,
                crate::cli::Command::Bench(a) => a.target,
                _ => unreachable!(),
            };
            assert_eq!(target.devices, Some(DeviceSelection::List(vec![0, 1])));
        }
        let e = parse(&["kernelforge", "bench", "--model", "gpt2", "--devices", "0,0"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("GPU 0 twice"), "{e}");
        let help = parse(&["kernelforge", "bench", "--help"]).unwrap_err().to_string();
        assert!(help.contains("--devices <LIST|all>"), "{help}");

        let (gpus, note) = gpus_for_batch(&DeviceSelection::All, 2, 8).unwrap();
        assert_eq!((gpus, note), (vec![0, 1], None));
        let (gpus, note) = gpus_for_batch(&DeviceSelection::List(vec![1, 0]), 2, 1).unwrap();
        assert_eq!(gpus, vec![1]);
        let note = note.unwrap();
        assert!(
            note.contains("runs on 1 of the 2 GPUs") && note.contains("cuda:1"),
            "{note}"
        );
        assert_eq!(gpus_for_batch(&DeviceSelection::First, 4, 16).unwrap().0, vec![0]);
        let e = gpus_for_batch(&DeviceSelection::List(vec![2]), 2, 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no GPU 2"), "{e}");
        let e = gpus_for_batch(&DeviceSelection::All, 0, 4).unwrap_err().to_string();
        assert!(e.contains("no CUDA GPU"), "{e}");
    }

    /// `--model MODEL --device cpu` (shared by the command tests of this folder).
    pub(super) fn cpu_target(model: &str) -> ModelArgs {
        ModelArgs {
            model: model.to_string(),
            device: Some(Device::Cpu),
            unfused: false,
            dtype: Dtype::F32,
            root: None,
            devices: None,
        }
    }

    #[test]
    fn forward_and_generate_commands_on_a_tiny_model() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = GPT2Config::new(2, 2, 32, 64, 50257).unwrap();
        let w = GPT2Weights::random(&cfg, 5);
        let bin = dir.path().join("m.bin");
        let hf = dir.path().join("hf");
        write_llmc(&bin, &cfg, &w, LlmcVersion::F32).unwrap();
        write_hf_folder(&hf, &cfg, &w).unwrap();
        let mut outs = Vec::new();
        for model in [&bin, &hf] {
            let out = dir.path().join(format!("{}.npy", outs.len()));
            run_forward(&ForwardArgs {
                target: cpu_target(&model.display().to_string()),
                ids: vec!["15496,11,995".into()],
                prompt: None,
                logits_out: Some(out.clone()),
                json: true,
            })
            .unwrap();
            let (shape, data) = read_npy_f32(&out).unwrap();
            assert_eq!(shape, vec![3, 50257]);
            outs.push(data);
        }
        assert_eq!(outs[0], outs[1]);
        // A batch of sequences: [B, T, V], each row what the sequence gives alone.
        let batch_out = dir.path().join("batch.npy");
        let batch_args = ForwardArgs {
            target: cpu_target(&bin.display().to_string()),
            ids: vec!["15496,11,995".into(), "1,2,3".into()],
            prompt: None,
            logits_out: Some(batch_out.clone()),
            json: false,
        };
        run_forward(&batch_args).unwrap();
        let (shape, data) = read_npy_f32(&batch_out).unwrap();
        assert_eq!(shape, vec![2, 3, 50257]);
        assert_eq!(&data[..3 * 50257], &outs[0][..]);
        let ragged = ForwardArgs {
            ids: vec!["1,2,3".into(), "4,5".into()],
            ..batch_args.clone()
        };
        let e = run_forward(&ragged).unwrap_err().to_string();
        assert!(e.contains("sequence 1 has 2 tokens but sequence 0 has 3"), "{e}");
        let devices_on_cpu = ForwardArgs {
            target: ModelArgs {
                devices: Some(DeviceSelection::All),
                ..batch_args.target.clone()
            },
            ..batch_args
        };
        let e = run_forward(&devices_on_cpu).unwrap_err().to_string();
        assert!(e.contains("--devices all") && e.contains("--device cuda"), "{e}");
        let gen = GenerateArgs {
            target: cpu_target(&bin.display().to_string()),
            engine: EngineArgs::default(),
            prompt: Some("Hello".into()),
            ids: None,
            max_new_tokens: 3,
            sampling: sampling::SamplingArgs {
                greedy: true,
                ..Default::default()
            },
            batch: 2,
            print_ids: true,
            ignore_eot: false,
            json: false,
        };
        run_generate(&gen).unwrap();
        if !crate::gpu::device::driver_present() {
            let cuda = GenerateArgs {
                target: ModelArgs {
                    device: Some(Device::Cuda),
                    ..gen.target.clone()
                },
                ..gen.clone()
            };
            let msg = run_generate(&cuda).unwrap_err().to_string();
            assert!(msg.contains("no CUDA driver") && msg.contains("--device cpu"), "{msg}");
        }
        let unfused_cpu = GenerateArgs {
            target: ModelArgs {
                unfused: true,
                ..gen.target.clone()
            },
            ..gen.clone()
        };
        assert!(run_generate(&unfused_cpu)
            .unwrap_err()
            .to_string()
            .contains("--unfused"));
        let engine_on_cpu = GenerateArgs {
            engine: EngineArgs {
                decode_engine: Some(DecodeEngine::Graph),
            },
            ..gen.clone()
        };
        let msg = run_generate(&engine_on_cpu).unwrap_err().to_string();
        assert!(
            msg.contains("--decode-engine graph") && msg.contains("--device cuda"),
            "{msg}"
        );
        let bad = GenerateArgs { batch: 0, ..gen };
        assert!(run_generate(&bad).is_err());
    }
}
