//! What a compiled CUBIN tells a reader of the kernels beyond registers and shared memory: each
//! function's machine code size (its `.text.NAME` section). A kernel whose code outgrows the SM's
//! instruction caches fetches instructions from L2 while it runs; a persistent kernel that
//! switches between several kinds of task (the decode megakernel) runs its code cold each time.
//! Also which functions a module image (CUBIN or PTX) defines, so a loader asks only for those.

use object::{Object, ObjectSection};

/// The bytes were not the ELF file NVRTC writes for a real architecture.
#[derive(Debug, thiserror::Error)]
#[error("reading the CUBIN ({bytes} bytes) as an ELF file: {reason}")]
pub struct CubinError {
    bytes: usize,
    reason: String,
}

/// The machine code bytes of each function in `cubin`, in the file's order.
pub fn code_sizes(cubin: &[u8]) -> Result<Vec<(String, u64)>, CubinError> {
    let file = object::File::parse(cubin).map_err(|e| CubinError {
        bytes: cubin.len(),
        reason: e.to_string(),
    })?;
    Ok(file
        .sections()
        .filter_map(|section| {
            let function = section.name().ok()?.strip_prefix(".text.")?;
            Some((function.to_string(), section.size()))
        })
        .collect())
}

/// The `__global__` functions a module image defines: the `.text.NAME` sections of a CUBIN, or
/// the `.entry NAME` lines of PTX (a stand-in's image). `None` when it is neither.
pub fn entry_points(image: &[u8]) -> Option<Vec<String>> {
    if let Ok(sizes) = code_sizes(image) {
        return Some(sizes.into_iter().map(|(name, _)| name).collect());
    }
    let text = std::str::from_utf8(image).ok()?.trim_end_matches('\0');
    if !text.contains(".target") {
        return None;
    }
    Some(
        text.lines()
            .filter_map(|line| {
                let rest = line.trim_start().strip_prefix(".visible .entry ")?;
                let name = rest.split(|c: char| c == '(' || c.is_whitespace()).next()?;
                Some(name.to_string())
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::Source;
    use crate::gpu::compile::nvrtc_present;
    use crate::gpu::Compiler;

    #[test]
    fn ptx_entries_are_read_from_its_text() {
        let ptx = b".version 8.0\n.target sm_86\n.address_size 64\n\n\t// .globl\tk_main\n\
                    .visible .entry k_main(\n\t.param .u64 k_main_param_0\n)\n{\n\tret;\n}\n\
                    .visible .entry k_combine()\n{\n\tret;\n}\n\0";
        assert_eq!(
            entry_points(ptx),
            Some(vec!["k_main".to_string(), "k_combine".to_string()])
        );
        assert_eq!(entry_points(b"neither"), None);
    }

    #[test]
    fn bytes_that_are_not_elf_are_refused_with_their_size() {
        let e = code_sizes(b"not a cubin").unwrap_err().to_string();
        assert!(e.contains("11 bytes") && e.contains("ELF"), "{e}");
    }

    /// Needs NVRTC (not a GPU); where it is missing, the compiler must say so.
    #[test]
    fn each_kernel_of_a_cubin_has_its_code_size_and_a_longer_kernel_is_larger() {
        let Ok(compiler) = Compiler::new("sm_90") else {
            assert!(!nvrtc_present());
            eprintln!("NVRTC is missing here: the CUBIN's code sizes need it");
            return;
        };
        let source = Source {
            kernel_name: "sizes".into(),
            code: "extern \"C\" __global__ void sizes_short(float* out) { out[threadIdx.x] = 1.0f; }\n\
                   extern \"C\" __global__ void sizes_long(float* out, int n) {\n\
                       float acc = 0.0f;\n\
                       #pragma unroll\n\
                       for (int i = 0; i < 256; ++i) acc = acc * out[(i * 7 + n) % 1024] + 1.0f;\n\
                       out[threadIdx.x] = acc;\n\
                   }\n"
            .into(),
        };
        let compiled = compiler.compile(&source).unwrap();
        let sizes = code_sizes(&compiled.image).unwrap();
        eprintln!("code sizes: {sizes:?}");
        let size = |name: &str| {
            sizes
                .iter()
                .find(|(f, _)| f == name)
                .map(|(_, bytes)| *bytes)
                .unwrap_or_else(|| panic!("{name} in {sizes:?}"))
        };
        assert!(size("sizes_short") > 0);
        assert!(size("sizes_long") > 8 * size("sizes_short"), "{sizes:?}");
    }
}
