//! NVRTC compilation for the device's own architecture, behind an on-disk cache keyed by the
//! source, the options and the NVRTC version. Works without a GPU (for `inspect --arch`).

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result as nvrtc, sys};
use rayon::prelude::*;
use sha2::{Digest, Sha256};

use super::compile_workers::{self, WorkerPool};
use crate::codegen::Source;

/// Compilation failed; the message carries NVRTC's log and the source lines it points at.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error("NVRTC (libnvrtc.so) not found: install the CUDA toolkit, or put its lib folder on LD_LIBRARY_PATH")]
    NoNvrtc,
    #[error("NVRTC failed on {kernel} for {arch}:\n{log}{context}")]
    Failed {
        kernel: String,
        arch: String,
        log: String,
        context: String,
    },
    #[error("NVRTC call {call} failed for {kernel}: {message}")]
    Nvrtc {
        kernel: String,
        call: &'static str,
        message: String,
    },
    #[error("compiling {kernel} in a worker process: {message}")]
    Worker { kernel: String, message: String },
}

/// A compiled variant: the image to load and NVRTC's log (warnings).
#[derive(Debug, Clone)]
pub struct Compiled {
    pub kernel_name: String,
    /// The target it was compiled for: `sm_90a`, or `compute_86` for PTX.
    pub arch: String,
    /// The module image: a CUBIN for a real target (`sm_90`), NUL-terminated PTX for a virtual
    /// one (`compute_86`, a stand-in: the driver JIT-compiles it when it loads).
    pub image: Vec<u8>,
    /// NVRTC's warnings (ptxas's resource report taken out).
    pub log: String,
    /// Whether it came from the on-disk cache.
    pub cached: bool,
    /// Bytes of register spill stores ptxas reported, summed over the kernels (`None` when
    /// unknown: a cache entry written without its report).
    pub spill_stores: Option<u64>,
}

/// Splits NVRTC's log into the user-facing part and the sum of ptxas's `N bytes spill stores`
/// (the log of a compile with `--ptxas-options=-v`).
pub fn split_ptxas_report(log: &str) -> (String, u64) {
    let mut spills = 0;
    for line in log.lines().filter(|l| l.starts_with("ptxas")) {
        if let Some((before, _)) = line.split_once(" bytes spill stores") {
            // The number right before: `..., 24 bytes spill stores`.
            let digits = before.rsplit(|c: char| !c.is_ascii_digit()).next().unwrap_or("");
            spills += digits.parse::<u64>().unwrap_or(0);
        }
    }
    let rest: Vec<&str> = log.lines().filter(|l| !l.starts_with("ptxas")).collect();
    (rest.join("\n").trim().to_string(), spills)
}

/// Compiles CUDA sources with NVRTC for one architecture.
#[derive(Debug, Clone)]
pub struct Compiler {
    /// `sm_90` etc.; a virtual target (`compute_86`, see [`super::stand_in`]) compiles to PTX.
    pub arch: String,
    pub include_dir: Option<PathBuf>,
    pub cache_dir: Option<PathBuf>,
    pub nvrtc_version: (i32, i32),
}

/// The CUDA toolkit's include folder: `$CUDA_HOME/include`, `$CUDA_PATH/include`, then
/// `/usr/local/cuda/include`. NVRTC does not find toolkit headers (`<mma.h>`) by itself.
pub fn find_cuda_include() -> Option<PathBuf> {
    ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|v| std::env::var_os(v).map(|p| PathBuf::from(p).join("include")))
        .chain(std::iter::once(PathBuf::from("/usr/local/cuda/include")))
        .find(|p| p.join("cuda_runtime.h").is_file() || p.join("crt").is_dir())
}

/// The compile cache: `$KERNELFORGE_CACHE/nvrtc`, else the user cache folder.
pub fn default_cache_dir() -> Option<PathBuf> {
    std::env::var_os("KERNELFORGE_CACHE")
        .map(PathBuf::from)
        .or_else(|| dirs::cache_dir().map(|d| d.join("kernelforge")))
        .map(|d| d.join("nvrtc"))
}

/// Whether NVRTC can be loaded on this machine.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { sys::is_culib_present() }
}

impl Compiler {
    /// A compiler for `arch` (e.g. `sm_90`), with the default cache folder.
    pub fn new(arch: &str) -> Result<Compiler, CompileError> {
        if !nvrtc_present() {
            return Err(CompileError::NoNvrtc);
        }
        let (mut major, mut minor) = (0, 0);
        // SAFETY: plain out-parameter call; the library is present.
        unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
        Ok(Compiler {
            arch: arch.to_string(),
            include_dir: find_cuda_include(),
            cache_dir: default_cache_dir(),
            nvrtc_version: (major, minor),
        })
    }

    /// The compiler for `family`: the same one retargeted to the family's exact `[family] arch`
    /// (e.g. `sm_90a`, which Hopper's `wgmma` needs) when it names one, else this one. The
    /// target is the first NVRTC option, so it is part of every cache key.
    pub fn for_family(&self, family: &crate::spec::Family) -> Compiler {
        match &family.arch {
            Some(target) => Compiler {
                arch: target.name.clone(),
                ..self.clone()
            },
            None => self.clone(),
        }
    }

    /// The NVRTC options used for every compile.
    pub fn options(&self, arch: &str) -> Vec<String> {
        let mut options = vec![
            format!("--gpu-architecture={arch}"),
            "--std=c++17".to_string(),
            // Line tables cost nothing at run time and let compute-sanitizer and ncu point at
            // source lines.
            "--generate-line-info".to_string(),
        ];
        if let Some(dir) = &self.include_dir {
            options.push(format!("--include-path={}", dir.display()));
        }
        options
    }

    fn cache_key(&self, source: &Source, options: &[String]) -> String {
        let mut h = Sha256::new();
        h.update(format!("nvrtc {}.{}\n", self.nvrtc_version.0, self.nvrtc_version.1));
        for o in options {
            h.update(o.as_bytes());
            h.update(b"\n");
        }
        h.update(source.code.as_bytes());
        h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect()
    }

    /// Compiles to CUBIN (from the cache when the same source and options were compiled before).
    pub fn compile(&self, source: &Source) -> Result<Compiled, CompileError> {
        self.compile_via(source, None)
    }

    /// [`Compiler::compile`], with NVRTC run by a worker of `workers` when given.
    fn compile_via(&self, source: &Source, workers: Option<&WorkerPool>) -> Result<Compiled, CompileError> {
        let mut options = self.options(&self.arch);
        let output = Output::for_options(&options);
        // ptxas's resource report (registers, stack, spills) goes to the log: the tuner prunes
        // variants that spill before running them. PTX for a virtual target meets ptxas only in
        // the driver, so its spills are unknown.
        if output == Output::Cubin {
            options.push("--ptxas-options=--verbose".to_string());
        }
        let cache_file = self.cache_dir.as_ref().map(|d| {
            d.join(format!(
                "{}-{}.{}",
                source.kernel_name,
                self.cache_key(source, &options),
                output.extension()
            ))
        });
        // The spill count lives beside the CUBIN, written first (a CUBIN without it reads as
        // unknown, never as spill-free).
        let spill_file = |f: &PathBuf| f.with_extension("spills");
        if let Some(bytes) = cache_file.as_ref().and_then(|f| std::fs::read(f).ok()) {
            let spill_stores = cache_file
                .as_ref()
                .and_then(|f| std::fs::read_to_string(spill_file(f)).ok())
                .and_then(|t| t.trim().parse().ok());
            return Ok(Compiled {
                kernel_name: source.kernel_name.clone(),
                arch: self.arch.clone(),
                image: bytes,
                log: String::new(),
                cached: true,
                spill_stores,
            });
        }
        let in_worker = workers.and_then(|pool| pool.compile(&source.kernel_name, &source.code, &options));
        let (image, log) = match in_worker {
            Some(compiled) => compiled?,
            None => nvrtc_compile(&source.kernel_name, &source.code, &options, output)?,
        };
        let (log, spills) = split_ptxas_report(&log);
        let spill_stores = (output == Output::Cubin).then_some(spills);
        if let Some(file) = &cache_file {
            // A cache that cannot be written only costs time.
            let spills_written = match spill_stores {
                Some(spills) => write_atomic(&spill_file(file), spills.to_string().as_bytes()),
                None => true,
            };
            if spills_written {
                write_atomic(file, &image);
            }
        }
        Ok(Compiled {
            kernel_name: source.kernel_name.clone(),
            arch: self.arch.clone(),
            image,
            log,
            cached: false,
            spill_stores,
        })
    }

    /// Compiles many (family, source) pairs in parallel (in the worker processes of
    /// [`compile_workers::global`] when the binary set them up, else on threads: NVRTC is
    /// thread-safe across programs), each for its family's target (see
    /// [`Compiler::for_family`]); `on_done` sees each source as it finishes (progress bars).
    pub fn compile_all(
        &self,
        jobs: &[(&crate::spec::Family, &Source)],
        on_done: impl Fn(&Source) + Sync,
    ) -> Vec<Result<Compiled, CompileError>> {
        let workers = compile_workers::global();
        let results = jobs
            .par_iter()
            .map(|(family, source)| {
                let result = self.for_family(family).compile_via(source, workers);
                on_done(source);
                result
            })
            .collect();
        // A one-off batch (`verify`): no process per core left waiting after it.
        if let Some(pool) = workers {
            pool.release_idle();
        }
        results
    }

    /// Compiles many (family, source) pairs on `threads` threads (each handing its compile to
    /// a worker process when the binary set them up, see [`compile_workers`]), handing each
    /// result to `on_done` as it lands (the tuner measures a kernel while the others still
    /// compile, on its own thread, so it leaves one core free).
    pub fn compile_each(
        &self,
        jobs: &[(&crate::spec::Family, &Source)],
        threads: usize,
        on_done: impl Fn(&Source, Result<Compiled, CompileError>) + Sync,
    ) {
        let workers = compile_workers::global();
        let run = || {
            jobs.par_iter()
                .for_each(|(family, source)| on_done(source, self.for_family(family).compile_via(source, workers)))
        };
        match rayon::ThreadPoolBuilder::new().num_threads(threads.max(1)).build() {
            Ok(pool) => pool.install(run),
            Err(_) => run(),
        }
    }

    /// PTX for reading (`inspect --ptx`): compiled for the virtual architecture `compute_XY`
    /// (`compute_90a` for `sm_90a`).
    pub fn ptx(&self, source: &Source) -> Result<String, CompileError> {
        let virtual_arch = self.arch.replace("sm_", "compute_");
        let options = self.options(&virtual_arch);
        let (ptx, _) = nvrtc_compile(&source.kernel_name, &source.code, &options, Output::Ptx)?;
        Ok(String::from_utf8_lossy(&ptx).trim_end_matches('\0').to_string())
    }
}

/// Runs NVRTC in this process on `code` (named `kernel`) with `options`: the output asked for
/// and NVRTC's log.
pub(crate) fn nvrtc_compile(
    kernel: &str,
    code: &str,
    options: &[String],
    output: Output,
) -> Result<(Vec<u8>, String), CompileError> {
    let kernel = kernel.to_string();
    let call_err = |call: &'static str| {
        let kernel = kernel.clone();
        move |e: nvrtc::NvrtcError| CompileError::Nvrtc {
            kernel,
            call,
            message: format!("{e:?}"),
        }
    };
    let nul = |what: &str| CompileError::Nvrtc {
        kernel: kernel.clone(),
        call: "nvrtcCreateProgram",
        message: format!("the {what} contains a NUL byte"),
    };
    let c_code = CString::new(code.as_bytes()).map_err(|_| nul("source"))?;
    let name = CString::new(format!("{kernel}.cu")).map_err(|_| nul("kernel name"))?;
    let program = nvrtc::create_program(&c_code, Some(&name)).map_err(call_err("nvrtcCreateProgram"))?;
    let program = ProgramGuard(program);
    // SAFETY: `program` is a live program; options are valid C strings.
    let compiled = unsafe { nvrtc::compile_program(program.0, options) };
    // SAFETY: as above.
    let log = unsafe { nvrtc::get_program_log(program.0) }
        .map(|raw| {
            // SAFETY: NVRTC returns a NUL-terminated log.
            unsafe { CStr::from_ptr(raw.as_ptr()) }
                .to_string_lossy()
                .trim()
                .to_string()
        })
        .unwrap_or_default();
    if compiled.is_err() {
        return Err(CompileError::Failed {
            kernel,
            arch: options[0].trim_start_matches("--gpu-architecture=").to_string(),
            context: source_context(&log, code),
            log,
        });
    }
    let bytes = match output {
        Output::Ptx => {
            // SAFETY: the program compiled.
            let raw = unsafe { nvrtc::get_ptx(program.0) }.map_err(call_err("nvrtcGetPTX"))?;
            raw.into_iter().map(|c| c as u8).collect()
        }
        Output::Cubin => {
            let mut size = 0usize;
            // SAFETY: the program compiled for a real architecture; out-parameter call.
            unsafe { sys::nvrtcGetCUBINSize(program.0, &mut size) }
                .result()
                .map_err(call_err("nvrtcGetCUBINSize"))?;
            let mut buf = vec![0u8; size];
            // SAFETY: `buf` holds `size` bytes.
            unsafe { sys::nvrtcGetCUBIN(program.0, buf.as_mut_ptr().cast()) }
                .result()
                .map_err(call_err("nvrtcGetCUBIN"))?;
            buf
        }
    };
    Ok((bytes, log))
}

/// What NVRTC hands back: PTX, or a CUBIN (for a real target only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Output {
    Ptx,
    Cubin,
}

impl Output {
    /// What a compile with `options` gives: PTX for a virtual target (`compute_86`), else a
    /// CUBIN. The target is the `--gpu-architecture=` option.
    pub(crate) fn for_options(options: &[String]) -> Output {
        let virtual_target = options
            .iter()
            .filter_map(|o| o.strip_prefix("--gpu-architecture="))
            .any(|arch| arch.starts_with("compute_"));
        if virtual_target {
            Output::Ptx
        } else {
            Output::Cubin
        }
    }

    fn extension(self) -> &'static str {
        match self {
            Output::Ptx => "ptx",
            Output::Cubin => "cubin",
        }
    }
}

struct ProgramGuard(sys::nvrtcProgram);

impl Drop for ProgramGuard {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed once.
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

/// The source lines around the first `file(LINE): error` in an NVRTC log.
pub fn source_context(log: &str, code: &str) -> String {
    let line = log.lines().find_map(|l| {
        let (_, rest) = l.split_once('(')?;
        let (num, tail) = rest.split_once(')')?;
        tail.contains("error").then(|| num.parse::<usize>().ok()).flatten()
    });
    let Some(line) = line else { return String::new() };
    let lines: Vec<&str> = code.lines().collect();
    let first = line.saturating_sub(3).max(1);
    let last = (line + 3).min(lines.len());
    let mut out = format!("\nsource around line {line}:\n");
    for n in first..=last {
        let marker = if n == line { ">>" } else { "  " };
        out.push_str(&format!("{marker} {n:5} | {}\n", lines[n - 1]));
    }
    out
}

/// Writes `bytes` to `path` through a temporary file and a rename, so readers never see a
/// partial file. Errors are ignored by the callers that only cache.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> bool {
    let Some(dir) = path.parent() else { return false };
    if std::fs::create_dir_all(dir).is_err() {
        return false;
    }
    let Ok(mut tmp) = tempfile::NamedTempFile::new_in(dir) else {
        return false;
    };
    use std::io::Write;
    tmp.write_all(bytes).is_ok() && tmp.persist(path).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_report_gives_the_spills_and_leaves_the_warnings() {
        let log = "k.cu(509): warning #177-D: variable \"leader\" was declared but never referenced\n\
                   ptxas info    : 44 bytes gmem\n\
                   ptxas info    : Function properties for a_main\n\
                   ptxas         .     16 bytes stack frame, 24 bytes spill stores, 24 bytes spill loads\n\
                   ptxas info    : Function properties for a_reduce\n\
                   ptxas         .     0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n\
                   ptxas info    : Used 168 registers, used 16 barriers, 16 bytes cumulative stack size";
        let (rest, spills) = split_ptxas_report(log);
        assert_eq!(spills, 32);
        assert_eq!(
            rest,
            "k.cu(509): warning #177-D: variable \"leader\" was declared but never referenced"
        );
        assert_eq!(
            split_ptxas_report("ptxas . 16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads").1,
            0
        );
    }

    #[test]
    fn context_points_at_the_error_line() {
        let code = "a\nb\nc\nd\ne\nf\ng\nh";
        let log = "k.cu(5): error: identifier \"x\" is undefined";
        let ctx = source_context(log, code);
        assert!(ctx.contains(">>     5 | e"), "{ctx}");
        assert!(ctx.contains("      2 | b"), "{ctx}");
        assert!(!ctx.contains("| a"), "{ctx}");
        assert_eq!(source_context("no line here", code), "");
    }
}
