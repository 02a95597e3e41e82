//! NVRTC in worker processes, for batches of compiles (the tuner's rounds, `verify`).
//!
//! One process's NVRTC stops scaling at about 8 compiling threads: on the H100 host (32 cores)
//! 140 GEMM and attention kernels took 6.7 s on 16 threads of one process and 1.9 s in 4
//! processes of 8 threads. So a batch goes to a pool of single-threaded child processes, each
//! the same binary in a hidden mode (`kernelforge compile-worker`, which calls [`serve_stdio`]).
//! A worker that crashes costs the one kernel it was compiling, not the run; a worker that cannot
//! be started at all (the binary moved away) turns the pool off, and compiles go back to this
//! process ([`WorkerPool::unavailable`] says why).
//!
//! The pool is off until the binary names its worker program ([`use_worker_processes`]); a
//! library user without one compiles on threads as before.
//!
//! The protocol, over the worker's stdin and stdout, is frames of a little-endian `u32` length
//! and that many bytes: a request is the kernel name, the source and the NVRTC options joined by
//! NUL; a reply is a status (`ok`, `failed`, or the NVRTC call that failed) and two payloads
//! (CUBIN and log; or log; or message).

use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Condvar, Mutex, OnceLock};

use super::compile::{nvrtc_compile, nvrtc_present, CompileError, Output};

/// The program a worker runs: an executable and its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerProgram {
    pub exe: PathBuf,
    pub args: Vec<String>,
}

/// One compile asked of a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub kernel: String,
    pub code: String,
    pub options: Vec<String>,
}

/// A worker's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The CUBIN and NVRTC's log.
    Compiled { cubin: Vec<u8>, log: String },
    /// NVRTC refused the source; its log.
    Failed { log: String },
    /// An NVRTC call failed (or NVRTC is missing), with its message.
    Call { call: String, message: String },
}

static GLOBAL: OnceLock<WorkerPool> = OnceLock::new();

/// Compile batches in worker processes running `program` from now on, one per core but one
/// (the tuner verifies and times on its own thread meanwhile; on the 16-core H100 host 15
/// workers tuned GPT-2 in 28.0 s, 16 in 29.5 s). `KERNELFORGE_COMPILE_WORKERS=0` keeps
/// compiles on threads of this process; another number sets the pool's size. The first call
/// wins; later calls change nothing.
pub fn use_worker_processes(program: WorkerProgram) {
    let size = match std::env::var("KERNELFORGE_COMPILE_WORKERS")
        .ok()
        .map(|v| v.trim().parse::<usize>())
    {
        Some(Ok(0)) => return,
        Some(Ok(n)) => n,
        _ => std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1)),
    };
    let _ = GLOBAL.set(WorkerPool::new(program, size));
}

/// The process-wide pool, when the binary set one up.
pub fn global() -> Option<&'static WorkerPool> {
    GLOBAL.get()
}

/// Child processes that compile, started on demand up to `max` and kept for later batches.
pub struct WorkerPool {
    program: WorkerProgram,
    max: usize,
    state: Mutex<PoolState>,
    returned: Condvar,
}

#[derive(Default)]
struct PoolState {
    idle: Vec<Worker>,
    /// Workers alive (idle or busy).
    live: usize,
    /// Why no worker can be started (the pool is off for good).
    unavailable: Option<String>,
}

struct Worker {
    child: Child,
    input: BufWriter<ChildStdin>,
    output: BufReader<ChildStdout>,
}

impl WorkerPool {
    pub fn new(program: WorkerProgram, max: usize) -> WorkerPool {
        WorkerPool {
            program,
            max: max.max(1),
            state: Mutex::new(PoolState::default()),
            returned: Condvar::new(),
        }
    }

    /// Ends the idle workers (busy ones finish and stay): after a one-off batch (`verify`,
    /// or a library caller's `compile_all`) no process per core is left waiting. The next
    /// batch starts new ones.
    pub fn release_idle(&self) {
        let idle = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let idle = std::mem::take(&mut state.idle);
            state.live -= idle.len();
            idle
        };
        end_all(idle);
    }

    /// Workers alive, idle or busy.
    pub fn live(&self) -> usize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).live
    }

    /// Why the pool is off (no worker could be started), if it is.
    pub fn unavailable(&self) -> Option<String> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).unavailable.clone()
    }

    /// Compiles `code` with `options` in a worker (waiting for one while all are busy): NVRTC's
    /// output and log, as NVRTC in this process would give them. `None` when no worker can be
    /// started (see [`WorkerPool::unavailable`]): the caller compiles itself.
    pub fn compile(
        &self,
        kernel: &str,
        code: &str,
        options: &[String],
    ) -> Option<Result<(Vec<u8>, String), CompileError>> {
        let worker_err = |message: String| CompileError::Worker {
            kernel: kernel.to_string(),
            message,
        };
        let mut worker = self.checkout()?;
        let request = Request {
            kernel: kernel.to_string(),
            code: code.to_string(),
            options: options.to_vec(),
        };
        let exchanged = write_request(&mut worker.input, &request)
            .and_then(|()| worker.input.flush())
            .and_then(|()| read_reply(&mut worker.output));
        Some(match exchanged {
            Ok(reply) => {
                self.checkin(worker);
                match reply {
                    Reply::Compiled { cubin, log } => Ok((cubin, log)),
                    Reply::Failed { log } => Err(CompileError::Failed {
                        kernel: kernel.to_string(),
                        arch: arch_of(options),
                        context: super::compile::source_context(&log, code),
                        log,
                    }),
                    Reply::Call { call, message } => Err(worker_err(format!("{call}: {message}"))),
                }
            }
            Err(e) => {
                let status = self.retire(worker);
                Err(worker_err(format!(
                    "the compile worker died while compiling it ({status}; {e}); NVRTC may have crashed on this source"
                )))
            }
        })
    }

    /// An idle worker, a new one, or (all busy) the next one returned; `None` once no worker
    /// can be started.
    fn checkout(&self) -> Option<Worker> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(worker) = state.idle.pop() {
                return Some(worker);
            }
            if state.unavailable.is_some() {
                return None;
            }
            if state.live < self.max {
                state.live += 1;
                drop(state);
                let started = self.spawn();
                let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                return match started {
                    Ok(worker) => Some(worker),
                    Err(e) => {
                        state.live -= 1;
                        state.unavailable = Some(format!(
                            "could not start the compile worker `{}`: {e}",
                            self.program.exe.display()
                        ));
                        // Threads waiting for a worker must see that none will come.
                        self.returned.notify_all();
                        None
                    }
                };
            }
            state = self.returned.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn spawn(&self) -> io::Result<Worker> {
        let mut child = Command::new(&self.program.exe)
            .args(&self.program.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let input = BufWriter::new(child.stdin.take().expect("stdin is piped"));
        let output = BufReader::new(child.stdout.take().expect("stdout is piped"));
        Ok(Worker { child, input, output })
    }

    fn checkin(&self, worker: Worker) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).idle.push(worker);
        self.returned.notify_one();
    }

    /// Ends a worker that failed; its exit status, in words.
    fn retire(&self, mut worker: Worker) -> String {
        let _ = worker.child.kill();
        let status = worker
            .child
            .wait()
            .map_or_else(|e| format!("its status is unknown: {e}"), |s| s.to_string());
        self.state.lock().unwrap_or_else(|e| e.into_inner()).live -= 1;
        self.returned.notify_one();
        status
    }
}

/// Closing a worker's stdin ends it; waiting leaves no zombie.
fn end_all(workers: Vec<Worker>) {
    for mut worker in workers {
        drop(worker.input);
        let _ = worker.child.wait();
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        end_all(std::mem::take(
            &mut self.state.get_mut().unwrap_or_else(|e| e.into_inner()).idle,
        ));
    }
}

/// The worker's side: answers requests from stdin on stdout until stdin closes.
pub fn serve_stdio() -> io::Result<()> {
    let stdin = io::stdin().lock();
    let stdout = io::stdout().lock();
    serve(stdin, stdout, compile_here)
}

/// Answers each request read from `input` with `compile`'s reply on `output`, until `input`
/// ends between two requests.
pub fn serve(input: impl Read, output: impl Write, compile: impl Fn(&Request) -> Reply) -> io::Result<()> {
    let mut input = BufReader::new(input);
    let mut output = BufWriter::new(output);
    while let Some(request) = read_request(&mut input)? {
        write_reply(&mut output, &compile(&request))?;
        output.flush()?;
    }
    Ok(())
}

/// What this process's NVRTC makes of a request.
fn compile_here(request: &Request) -> Reply {
    if !nvrtc_present() {
        return Reply::Call {
            call: "dlopen".into(),
            message: CompileError::NoNvrtc.to_string(),
        };
    }
    match nvrtc_compile(
        &request.kernel,
        &request.code,
        &request.options,
        Output::for_options(&request.options),
    ) {
        Ok((cubin, log)) => Reply::Compiled { cubin, log },
        Err(CompileError::Failed { log, .. }) => Reply::Failed { log },
        Err(CompileError::Nvrtc { call, message, .. }) => Reply::Call {
            call: call.to_string(),
            message,
        },
        Err(e) => Reply::Call {
            call: "nvrtc".into(),
            message: e.to_string(),
        },
    }
}

/// The target of a compile: the value of its `--gpu-architecture=` option.
fn arch_of(options: &[String]) -> String {
    options
        .iter()
        .find_map(|o| o.strip_prefix("--gpu-architecture="))
        .unwrap_or("?")
        .to_string()
}

fn write_frame(w: &mut impl Write, bytes: &[u8]) -> io::Result<()> {
    let len =
        u32::try_from(bytes.len()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a frame over 4 GiB"))?;
    w.write_all(&len.to_le_bytes())?;
    w.write_all(bytes)
}

/// A frame, or `None` when the stream ends before its first byte.
fn read_frame(r: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..])? {
            0 if got == 0 => return Ok(None),
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => got += n,
        }
    }
    let mut bytes = vec![0u8; u32::from_le_bytes(len) as usize];
    r.read_exact(&mut bytes)?;
    Ok(Some(bytes))
}

fn read_frames<const N: usize>(r: &mut impl Read) -> io::Result<Option<[Vec<u8>; N]>> {
    let mut frames: [Vec<u8>; N] = std::array::from_fn(|_| Vec::new());
    for (i, frame) in frames.iter_mut().enumerate() {
        match read_frame(r)? {
            Some(bytes) => *frame = bytes,
            None if i == 0 => return Ok(None),
            None => return Err(io::ErrorKind::UnexpectedEof.into()),
        }
    }
    Ok(Some(frames))
}

fn text(bytes: Vec<u8>) -> io::Result<String> {
    String::from_utf8(bytes).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

pub fn write_request(w: &mut impl Write, request: &Request) -> io::Result<()> {
    write_frame(w, request.kernel.as_bytes())?;
    write_frame(w, request.code.as_bytes())?;
    write_frame(w, request.options.join("\0").as_bytes())
}

/// The next request, or `None` when the stream ended between requests.
pub fn read_request(r: &mut impl Read) -> io::Result<Option<Request>> {
    let Some([kernel, code, options]) = read_frames::<3>(r)? else {
        return Ok(None);
    };
    let options = text(options)?;
    Ok(Some(Request {
        kernel: text(kernel)?,
        code: text(code)?,
        options: options
            .split('\0')
            .filter(|o| !o.is_empty())
            .map(str::to_string)
            .collect(),
    }))
}

pub fn write_reply(w: &mut impl Write, reply: &Reply) -> io::Result<()> {
    let (status, first, second): (&[u8], &[u8], &[u8]) = match reply {
        Reply::Compiled { cubin, log } => (b"ok", cubin, log.as_bytes()),
        Reply::Failed { log } => (b"failed", log.as_bytes(), b""),
        Reply::Call { call, message } => (call.as_bytes(), message.as_bytes(), b""),
    };
    write_frame(w, status)?;
    write_frame(w, first)?;
    write_frame(w, second)
}

pub fn read_reply(r: &mut impl Read) -> io::Result<Reply> {
    let [status, first, second] = read_frames::<3>(r)?.ok_or(io::ErrorKind::UnexpectedEof)?;
    Ok(match status.as_slice() {
        b"ok" => Reply::Compiled {
            cubin: first,
            log: text(second)?,
        },
        b"failed" => Reply::Failed { log: text(first)? },
        _ => Reply::Call {
            call: text(status)?,
            message: text(first)?,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(kernel: &str) -> Request {
        Request {
            kernel: kernel.into(),
            code: format!("extern \"C\" __global__ void {kernel}() {{}}\n// ünïcode\n"),
            options: vec!["--gpu-architecture=sm_90".into(), "--std=c++17".into()],
        }
    }

    #[test]
    fn requests_and_replies_cross_a_pipe_intact() {
        let requests = [request("a"), request("bb"), request("ccc")];
        let mut wire = Vec::new();
        for r in &requests {
            write_request(&mut wire, r).unwrap();
        }
        // A fake compiler: a CUBIN with every byte value for the first kernel, a failure with
        // the kernel's name in the log, then a failed call.
        let mut answers = Vec::new();
        serve(wire.as_slice(), &mut answers, |r| match r.kernel.as_str() {
            "a" => Reply::Compiled {
                cubin: (0..=255u8).chain(r.code.bytes()).collect(),
                log: r.options.join(" "),
            },
            "bb" => Reply::Failed {
                log: format!("{}.cu(2): error: nope", r.kernel),
            },
            _ => Reply::Call {
                call: "nvrtcGetCUBIN".into(),
                message: r.code.clone(),
            },
        })
        .unwrap();
        let mut answers = answers.as_slice();
        assert_eq!(
            read_reply(&mut answers).unwrap(),
            Reply::Compiled {
                cubin: (0..=255u8).chain(requests[0].code.bytes()).collect(),
                log: "--gpu-architecture=sm_90 --std=c++17".into()
            }
        );
        assert_eq!(
            read_reply(&mut answers).unwrap(),
            Reply::Failed {
                log: "bb.cu(2): error: nope".into()
            }
        );
        assert_eq!(
            read_reply(&mut answers).unwrap(),
            Reply::Call {
                call: "nvrtcGetCUBIN".into(),
                message: requests[2].code.clone()
            }
        );
        assert!(answers.is_empty());
    }

    #[test]
    fn a_stream_cut_inside_a_request_is_an_error_not_the_end() {
        let mut wire = Vec::new();
        write_request(&mut wire, &request("k")).unwrap();
        assert_eq!(read_request(&mut wire.as_slice()).unwrap(), Some(request("k")));
        assert_eq!(read_request(&mut &wire[..0]).unwrap(), None);
        for cut in [2, 5, wire.len() - 1] {
            let err = read_request(&mut &wire[..cut]).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "cut at {cut}");
        }
    }

    #[cfg(unix)]
    #[test]
    fn a_worker_that_dies_costs_its_kernel_and_is_replaced() {
        // Each "worker" reads nothing and exits with status 3.
        let pool = WorkerPool::new(
            WorkerProgram {
                exe: "sh".into(),
                args: vec!["-c".into(), "exit 3".into()],
            },
            2,
        );
        for kernel in ["first_kernel", "second_kernel", "third_kernel"] {
            let err = pool
                .compile(kernel, "code", &["--gpu-architecture=sm_90".into()])
                .expect("the worker starts")
                .unwrap_err();
            let text = err.to_string();
            assert!(text.contains(kernel), "{text}");
            assert!(text.contains("exit status: 3"), "{text}");
        }
        assert_eq!(pool.state.lock().unwrap().live, 0);
        assert!(
            pool.unavailable().is_none(),
            "a worker that dies does not turn the pool off"
        );
    }

    #[test]
    fn a_worker_program_that_cannot_start_turns_the_pool_off_and_says_why() {
        let pool = WorkerPool::new(
            WorkerProgram {
                exe: "/nonexistent/kernelforge".into(),
                args: vec![],
            },
            2,
        );
        assert!(pool.unavailable().is_none());
        // Several threads at once: each is told to compile itself, none waits forever.
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| assert!(pool.compile("k", "code", &[]).is_none()));
            }
        });
        let why = pool.unavailable().unwrap();
        assert!(why.contains("/nonexistent/kernelforge"), "{why}");
        assert_eq!(pool.state.lock().unwrap().live, 0);
    }
}
