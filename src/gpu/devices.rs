//! Which GPUs a command runs on: `--devices LIST|all` parsed, checked against the machine, and
//! the batch sliced across the chosen devices in proportion to what each can take.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use crate::spec::DeviceLimits;

/// `--devices` as written: not given (the first GPU), `all`, or a list of CUDA ordinals.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DeviceSelection {
    /// GPU 0 only (the default).
    #[default]
    First,
    /// Every GPU the driver reports.
    All,
    /// These ordinals, in this order, each once.
    List(Vec<usize>),
}

/// A `--devices` value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceListError {
    #[error("--devices `{text}`: `{item}` is not a GPU index (expected `all` or indices such as 0,1)")]
    NotAnIndex { text: String, item: String },
    #[error("--devices `{text}` is empty (expected `all` or indices such as 0,1)")]
    Empty { text: String },
    #[error("--devices `{text}` names GPU {ordinal} twice; list each GPU once")]
    Repeated { text: String, ordinal: usize },
    #[error("--devices: there is no GPU {ordinal}: this machine has {count} ({}); `nvidia-smi -L` lists them", known(*count))]
    NoSuchDevice { ordinal: usize, count: usize },
    #[error("--devices: this machine has no CUDA GPU")]
    NoGpu,
}

fn known(count: usize) -> String {
    match count {
        0 => "none".to_string(),
        1 => "GPU 0".to_string(),
        n => format!("GPUs 0 to {}", n - 1),
    }
}

impl FromStr for DeviceSelection {
    type Err = DeviceListError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let trimmed = text.trim();
        if trimmed.eq_ignore_ascii_case("all") {
            return Ok(DeviceSelection::All);
        }
        let mut list = Vec::new();
        for item in trimmed.split(',').map(str::trim) {
            let item = item.strip_prefix("cuda:").unwrap_or(item);
            let ordinal: usize = item.parse().map_err(|_| DeviceListError::NotAnIndex {
                text: text.to_string(),
                item: item.to_string(),
            })?;
            if list.contains(&ordinal) {
                return Err(DeviceListError::Repeated {
                    text: text.to_string(),
                    ordinal,
                });
            }
            list.push(ordinal);
        }
        if list.is_empty() {
            return Err(DeviceListError::Empty { text: text.to_string() });
        }
        Ok(DeviceSelection::List(list))
    }
}

impl fmt::Display for DeviceSelection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSelection::First => f.write_str("0"),
            DeviceSelection::All => f.write_str("all"),
            DeviceSelection::List(l) => {
                let text: Vec<String> = l.iter().map(usize::to_string).collect();
                f.write_str(&text.join(","))
            }
        }
    }
}

impl DeviceSelection {
    /// The ordinals on a machine with `count` GPUs.
    pub fn resolve(&self, count: usize) -> Result<Vec<usize>, DeviceListError> {
        if count == 0 {
            return Err(DeviceListError::NoGpu);
        }
        match self {
            DeviceSelection::First => Ok(vec![0]),
            DeviceSelection::All => Ok((0..count).collect()),
            DeviceSelection::List(list) => match list.iter().find(|&&o| o >= count) {
                Some(&ordinal) => Err(DeviceListError::NoSuchDevice { ordinal, count }),
                None => Ok(list.clone()),
            },
        }
    }

    /// Whether more than one GPU may be meant (`all` or a list of several).
    pub fn is_several(&self) -> bool {
        match self {
            DeviceSelection::First => false,
            DeviceSelection::All => true,
            DeviceSelection::List(l) => l.len() > 1,
        }
    }
}

/// How many GPUs the driver reports (0 when there is no driver).
pub fn device_count() -> Result<usize, super::GpuError> {
    if !super::device::driver_present() {
        return Ok(0);
    }
    let n = cudarc::driver::CudaContext::device_count().map_err(super::GpuError::cuda("counting the GPUs"))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The number of SMs of GPU `ordinal` (what [`slice_batch`] weighs devices by), read without
/// creating a CUDA context.
pub fn sm_count(ordinal: usize) -> Result<usize, super::GpuError> {
    use cudarc::driver::{result, sys::CUdevice_attribute};
    if !super::device::driver_present() {
        return Err(super::GpuError::NoDriver);
    }
    result::init().map_err(super::GpuError::cuda("initializing the CUDA driver"))?;
    let no_device = |source| super::GpuError::NoDevice { ordinal, source };
    let device = result::device::get(i32::try_from(ordinal).unwrap_or(i32::MAX)).map_err(no_device)?;
    // SAFETY: `device` is a valid handle from cuDeviceGet; the call only reads an attribute.
    let sms =
        unsafe { result::device::get_attribute(device, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) }
            .map_err(super::GpuError::cuda(format!("reading the SM count of cuda:{ordinal}")))?;
    Ok(usize::try_from(sms).unwrap_or(0))
}

/// What a GPU is, read without creating a CUDA context: enough to group GPUs by kind, name
/// their tuning database and list the kernel variants valid on them.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeviceIdentity {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    #[serde(skip)]
    pub limits: DeviceLimits,
    /// The older GPU this one stands in for (`--target`), if any.
    #[serde(skip)]
    pub stand_in: Option<&'static super::StandIn>,
}

impl DeviceIdentity {
    /// `cuda:1 (NVIDIA H200)`: how errors and progress name the device.
    pub fn label(&self) -> String {
        format!("cuda:{} ({})", self.ordinal, self.name)
    }

    /// What NVRTC compiles for: `sm_90` for compute capability 9.0, or the stand-in's PTX
    /// target (`compute_86`).
    pub fn arch(&self) -> String {
        super::stand_in::compile_arch(self.compute_capability, self.stand_in)
    }
}

/// Name, compute capability and limits of GPU `ordinal`, read without creating a CUDA context
/// (as [`sm_count`]). An ordinal the driver does not know is [`super::GpuError::NoDevice`].
pub fn identify(ordinal: usize) -> Result<DeviceIdentity, super::GpuError> {
    use cudarc::driver::{result, sys::CUdevice_attribute as Attr};
    if !super::device::driver_present() {
        return Err(super::GpuError::NoDriver);
    }
    result::init().map_err(super::GpuError::cuda("initializing the CUDA driver"))?;
    let no_device = |source| super::GpuError::NoDevice { ordinal, source };
    let device = result::device::get(i32::try_from(ordinal).unwrap_or(i32::MAX)).map_err(no_device)?;
    let attr = |a: Attr| {
        // SAFETY: `device` is a valid handle from cuDeviceGet; the call only reads an attribute.
        unsafe { result::device::get_attribute(device, a) }
            .map(i64::from)
            .map_err(super::GpuError::cuda(format!("reading an attribute of cuda:{ordinal}")))
    };
    let compute_capability = (
        attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as i32,
        attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as i32,
    );
    let limits = super::device::read_limits(attr, compute_capability)?;
    let name = result::device::get_name(device)
        .map_err(super::GpuError::cuda(format!("reading the name of cuda:{ordinal}")))?;
    let stand_in = super::stand_in::active()?;
    let (name, compute_capability, limits) = super::stand_in::seen_as(stand_in, name, compute_capability, limits);
    Ok(DeviceIdentity {
        ordinal,
        name,
        compute_capability,
        limits,
        stand_in,
    })
}

/// Cuts `batch` sequences into one contiguous range per device, in proportion to `weights`
/// (what each device can take: equal weights give equal slices, the first devices taking one
/// more when the batch does not divide). Largest remainder rounding, ties to the earlier
/// device. Every device with a positive weight gets at least one sequence when the batch is at
/// least the number of such devices; devices beyond that get an empty range.
pub fn slice_batch(batch: usize, weights: &[f64]) -> Vec<Range<usize>> {
    let usable: Vec<f64> = weights
        .iter()
        .map(|&w| if w.is_finite() && w > 0.0 { w } else { 0.0 })
        .collect();
    let total: f64 = usable.iter().sum();
    let n = usable.len();
    if n == 0 {
        return Vec::new();
    }
    let mut counts = vec![0usize; n];
    if total <= 0.0 {
        counts[0] = batch;
    } else {
        let shares: Vec<f64> = usable.iter().map(|w| batch as f64 * w / total).collect();
        for (c, s) in counts.iter_mut().zip(&shares) {
            *c = s.floor() as usize;
        }
        let left = batch - counts.iter().sum::<usize>();
        // Devices that would get nothing first (so each takes a sequence while there are
        // enough), then by the largest remainder.
        let mut order: Vec<usize> = (0..n).filter(|&i| usable[i] > 0.0).collect();
        order.sort_by(|&a, &b| {
            let empty = |i: usize| counts[i] == 0;
            empty(b)
                .cmp(&empty(a))
                .then((shares[b] - shares[b].floor()).total_cmp(&(shares[a] - shares[a].floor())))
                .then(a.cmp(&b))
        });
        for &i in order.iter().cycle().take(left) {
            counts[i] += 1;
        }
        // A device with a share but no sequence while another holds two or more: move one.
        for i in 0..n {
            if usable[i] > 0.0 && counts[i] == 0 {
                if let Some(j) = (0..n).filter(|&j| counts[j] > 1).max_by_key(|&j| counts[j]) {
                    counts[j] -= 1;
                    counts[i] += 1;
                }
            }
        }
    }
    let mut start = 0;
    counts
        .into_iter()
        .map(|c| {
            let r = start..start + c;
            start += c;
            r
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_lists_parse_and_resolve() {
        assert_eq!("all".parse(), Ok(DeviceSelection::All));
        assert_eq!(" ALL ".parse(), Ok(DeviceSelection::All));
        assert_eq!("1".parse(), Ok(DeviceSelection::List(vec![1])));
        assert_eq!("0, 1".parse(), Ok(DeviceSelection::List(vec![0, 1])));
        assert_eq!("cuda:1,cuda:0".parse(), Ok(DeviceSelection::List(vec![1, 0])));
        let e = "0,x".parse::<DeviceSelection>().unwrap_err().to_string();
        assert!(e.contains("`x` is not a GPU index") && e.contains("0,1"), "{e}");
        let e = "0,0".parse::<DeviceSelection>().unwrap_err().to_string();
        assert!(e.contains("GPU 0 twice"), "{e}");
        assert!(matches!(
            "".parse::<DeviceSelection>(),
            Err(DeviceListError::NotAnIndex { .. })
        ));
        assert!("-1".parse::<DeviceSelection>().is_err());

        assert_eq!(DeviceSelection::First.resolve(4).unwrap(), vec![0]);
        assert_eq!(DeviceSelection::All.resolve(3).unwrap(), vec![0, 1, 2]);
        assert_eq!(DeviceSelection::List(vec![1]).resolve(2).unwrap(), vec![1]);
        let e = DeviceSelection::List(vec![0, 2]).resolve(2).unwrap_err().to_string();
        assert!(e.contains("no GPU 2") && e.contains("has 2 (GPUs 0 to 1)"), "{e}");
        let e = DeviceSelection::List(vec![1]).resolve(1).unwrap_err().to_string();
        assert!(e.contains("has 1 (GPU 0)"), "{e}");
        assert_eq!(DeviceSelection::All.resolve(0), Err(DeviceListError::NoGpu));
        assert!(DeviceSelection::All.is_several() && !DeviceSelection::First.is_several());
        assert!(!DeviceSelection::List(vec![1]).is_several());
        assert_eq!(DeviceSelection::List(vec![0, 1]).to_string(), "0,1");
    }

    fn lens(r: &[Range<usize>]) -> Vec<usize> {
        r.iter().map(|r| r.len()).collect()
    }

    #[test]
    fn batches_slice_in_proportion_contiguously_and_in_order() {
        assert_eq!(slice_batch(16, &[1.0, 1.0]), vec![0..8, 8..16]);
        assert_eq!(lens(&slice_batch(5, &[1.0, 1.0])), vec![3, 2]);
        assert_eq!(lens(&slice_batch(7, &[1.0, 1.0, 1.0])), vec![3, 2, 2]);
        assert_eq!(lens(&slice_batch(8, &[132.0, 66.0])), vec![5, 3]);
        assert_eq!(lens(&slice_batch(1, &[1.0, 1.0])), vec![1, 0]);
        assert_eq!(lens(&slice_batch(2, &[1.0, 1.0, 1.0])), vec![1, 1, 0]);
        // A small device still gets a sequence when there are enough.
        assert_eq!(lens(&slice_batch(2, &[100.0, 1.0])), vec![1, 1]);
        assert_eq!(lens(&slice_batch(3, &[1.0, 0.0, 1.0])), vec![2, 0, 1]);
        assert_eq!(lens(&slice_batch(4, &[0.0, 0.0])), vec![4, 0]);
        assert_eq!(slice_batch(0, &[1.0, 1.0]), vec![0..0, 0..0]);
        assert!(slice_batch(3, &[]).is_empty());
        for batch in 0..40 {
            for weights in [&[1.0, 2.0, 3.0][..], &[5.0, 5.0], &[1.0], &[0.5, 0.25, 0.25, 7.0]] {
                let r = slice_batch(batch, weights);
                assert_eq!(r.len(), weights.len());
                assert_eq!(r.iter().map(|r| r.len()).sum::<usize>(), batch);
                for pair in r.windows(2) {
                    assert_eq!(pair[0].end, pair[1].start, "contiguous");
                }
                assert_eq!(r[0].start, 0);
                if batch >= weights.len() {
                    assert!(r.iter().all(|r| !r.is_empty()), "{batch} {weights:?} {r:?}");
                }
            }
        }
    }
}
