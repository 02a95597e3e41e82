//! What a spec can say about the device: the exact architecture a family is built for, and the
//! limits its expressions may read.

use serde::Deserialize;

/// An exact compile target from `[family] arch`, e.g. `sm_90a`.
///
/// Architecture-specific targets (the `a` suffix) unlock instructions that exist on exactly one
/// compute capability (Hopper's `wgmma` and `setmaxnreg` need `sm_90a`) and are neither forward
/// nor backward compatible, so a family that names one is compiled for exactly that target and
/// offered only on devices of exactly that compute capability: elsewhere `verify` skips it with
/// the reason, and the tuner and the registry never pick it. A plain `sm_XY` is allowed too and
/// is treated the same way (compiled for it, run only on X.Y).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArchTarget {
    /// What NVRTC gets as `--gpu-architecture`: `sm_90a`.
    pub name: String,
    /// The only compute capability it runs on: (9, 0).
    pub compute_capability: (i32, i32),
}

impl ArchTarget {
    /// Parses `sm_<major><minor>` with an optional `a` suffix (`sm_90a`, `sm_100a`, `sm_80`).
    pub fn parse(text: &str) -> Result<ArchTarget, String> {
        let bad = || {
            format!(
                "`{text}` is not a GPU target: write sm_<major><minor>, optionally with the \
                 architecture-specific suffix `a` (e.g. sm_90a for Hopper's wgmma)"
            )
        };
        let digits = text.strip_prefix("sm_").ok_or_else(bad)?;
        let digits = digits.strip_suffix('a').unwrap_or(digits);
        if !(2..=3).contains(&digits.len()) || !digits.chars().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        let (major, minor) = digits.split_at(digits.len() - 1);
        let major: i32 = major.parse().map_err(|_| bad())?;
        let minor: i32 = minor.parse().map_err(|_| bad())?;
        if major < 5 {
            return Err(bad());
        }
        Ok(ArchTarget {
            name: text.to_string(),
            compute_capability: (major, minor),
        })
    }

    /// `Err` says why a device of compute capability `cc` cannot run code built for this target.
    pub fn check_device(&self, cc: (i32, i32)) -> Result<(), String> {
        if cc == self.compute_capability {
            Ok(())
        } else {
            Err(format!(
                "built for {} only (compute capability {}.{}); this GPU is {}.{}",
                self.name, self.compute_capability.0, self.compute_capability.1, cc.0, cc.1
            ))
        }
    }
}

/// What the device allows; expressions see these as `max_threads`, `max_smem_static`,
/// `max_smem_dynamic`, `num_sms`, `warp_size` and `compute_capability` (86 for 8.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct DeviceLimits {
    pub max_threads: i64,
    pub max_smem_static: i64,
    pub max_smem_dynamic: i64,
    pub num_sms: i64,
    pub warp_size: i64,
    /// Compute capability (major, minor). It decides which families with an exact
    /// `[family] arch` target or a `min_arch` may run at all; expressions see it as one number
    /// (`compute_capability`, 86 for 8.6), for parameters that need a newer GPU.
    #[serde(default = "hopper")]
    pub compute_capability: (i32, i32),
}

fn hopper() -> (i32, i32) {
    (9, 0)
}

impl Default for DeviceLimits {
    /// The limits used without a GPU (`gen`, CPU tests): those of an H100.
    fn default() -> Self {
        DeviceLimits {
            max_threads: 1024,
            max_smem_static: 48 * 1024,
            max_smem_dynamic: 227 * 1024,
            num_sms: 132,
            warp_size: 32,
            compute_capability: hopper(),
        }
    }
}

impl DeviceLimits {
    pub(super) fn vars(&self) -> [(&'static str, i64); 6] {
        let (major, minor) = self.compute_capability;
        [
            ("max_threads", self.max_threads),
            ("max_smem_static", self.max_smem_static),
            ("max_smem_dynamic", self.max_smem_dynamic),
            ("num_sms", self.num_sms),
            ("warp_size", self.warp_size),
            ("compute_capability", i64::from(major) * 10 + i64::from(minor)),
        ]
    }
}

pub(super) const DEVICE_VARS: [&str; 6] = [
    "max_threads",
    "max_smem_static",
    "max_smem_dynamic",
    "num_sms",
    "warp_size",
    "compute_capability",
];
