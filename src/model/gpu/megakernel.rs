//! placeholder
use super::select::Kernels;
use super::GpuBackend;
use anyhow::Result as AnyResult;
impl GpuBackend {
    pub(super) fn megakernel_step(&mut self, _ks: &Kernels, _b: usize, _pos: usize) -> AnyResult<()> {
        anyhow::bail!("not yet")
    }
}
