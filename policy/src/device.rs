//! Which Burn backend runs the model, chosen at run time (`--device`,
//! `[model] device`), and in which floating-point precision it computes
//! (`[model] precision`).
//!
//! Why a choice of our own rather than Burn's `Device::default()`: that
//! one picks the "best" compiled backend silently, so a binary built with
//! `wgpu` would move every command onto a GPU (or a software Vulkan
//! driver) without being asked. Here the CPU stays the default and a
//! backend the binary was not built with is refused by name.

use std::{fmt, str::FromStr};

use burn::{prelude::*, tensor::FloatDType};
use serde::{Deserialize, Serialize};

/// The backend a command runs the model on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDevice {
    /// Burn's `flex`, pure Rust, with this crate's fused kernels.
    #[default]
    Cpu,
    /// Burn's wgpu backend (Vulkan, Metal, DX12; on a machine without a
    /// GPU, a software Vulkan driver such as lavapipe). Feature `wgpu`.
    Wgpu,
    /// The first CUDA device. Feature `cuda`.
    Cuda,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum DeviceError {
    #[error(
        "device {0:?}: this binary was built without the `{0}` cargo feature \
         (rebuild with `--features {0}`)"
    )]
    NotBuilt(&'static str),
    #[error(
        "device wgpu: no usable adapter ({0}); on a machine without a GPU, install a \
             software Vulkan driver (Debian: mesa-vulkan-drivers)"
    )]
    Unavailable(String),
    #[error(
        "precision {precision} on wgpu: the adapter {adapter} cannot compute in {precision} \
         (its shaders have no {precision} type); use precision = \"f32\" there"
    )]
    PrecisionUnsupported {
        precision: Precision,
        adapter: String,
    },
    #[error(
        "WGPU_BACKEND = {0:?}: expected one of vulkan, metal, dx12, gl, webgpu \
         (or unset: wgpu picks)"
    )]
    UnknownGraphicsApi(String),
    #[error("unknown device {0:?}: expected cpu, wgpu or cuda")]
    Unknown(String),
    #[error(
        "precision bf16 on wgpu: WGSL has no bf16 type; use precision = \"f16\" \
         (or bf16 on cpu or cuda)"
    )]
    Bf16OnWgpu,
    #[error("unknown precision {0:?}: expected f32, bf16 or f16")]
    UnknownPrecision(String),
}

impl ComputeDevice {
    pub const ALL: [ComputeDevice; 3] = [Self::Cpu, Self::Wgpu, Self::Cuda];

    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Wgpu => "wgpu",
            Self::Cuda => "cuda",
        }
    }

    /// Whether this binary carries the backend.
    pub fn is_built(self) -> bool {
        match self {
            Self::Cpu => true,
            Self::Wgpu => cfg!(feature = "wgpu"),
            Self::Cuda => cfg!(feature = "cuda"),
        }
    }

    /// Refuses a precision this backend cannot compute in.
    pub fn check(self, precision: Precision) -> Result<(), DeviceError> {
        match (self, precision) {
            (Self::Wgpu, Precision::Bf16) => Err(DeviceError::Bf16OnWgpu),
            _ => Ok(()),
        }
    }

    /// The Burn device, or why this binary cannot give it. wgpu starts
    /// here (once per process); CUDA with the first tensor put on it.
    pub fn device(self) -> Result<Device, DeviceError> {
        match self {
            Self::Cpu => Ok(Device::flex()),
            Self::Wgpu => wgpu_device().map(|(d, _)| d),
            Self::Cuda => cuda_device(),
        }
    }

    /// The Burn device, refused by name unless it can compute in
    /// `precision`. Asked of the adapter at start, because a dtype the
    /// adapter lacks otherwise fails deep inside the backend: a panic
    /// from a kernel launch, or a shader that does not compile and a
    /// process that waits for it forever.
    pub fn device_for(self, precision: Precision) -> Result<Device, DeviceError> {
        self.check(precision)?;
        let device = self.device()?;
        if self == Self::Wgpu
            && !device.supports_dtype(precision.dtype())
            && std::env::var_os(SKIP_DTYPE_CHECK).is_none()
        {
            return Err(DeviceError::PrecisionUnsupported {
                precision,
                adapter: self.adapter().unwrap_or_else(|| "?".into()),
            });
        }
        Ok(device)
    }

    /// The adapter and graphics API wgpu chose, for the log; `None` on
    /// other devices or when wgpu has none.
    pub fn adapter(self) -> Option<String> {
        match self {
            Self::Wgpu => wgpu_device().ok().map(|(_, a)| a),
            _ => None,
        }
    }
}

/// Set, the wgpu dtype check is skipped: only to provoke, in a test, the
/// backend failure the check exists to prevent.
pub const SKIP_DTYPE_CHECK: &str = "BAPO_WGPU_SKIP_DTYPE_CHECK";

/// Whether a panic at `file` came from inside a GPU backend (cubecl's
/// kernels and runtimes, Burn's cubecl and fusion layers, wgpu itself).
pub fn is_gpu_backend_file(file: &str) -> bool {
    [
        "cubecl",
        "cubek",
        "burn-cubecl",
        "burn-fusion",
        "burn-wgpu",
        "burn-cuda",
        "wgpu",
    ]
    .iter()
    .any(|krate| file.contains(&format!("/{krate}-")) || file.contains(&format!("/{krate}/")))
}

/// The wgpu device for a test that runs there where it can: `None`, with a
/// line saying why the test skips, when this binary or machine has none.
/// `BAPO_REQUIRE_WGPU` fails the test instead, so the GPU code path cannot
/// quietly stop being executed: `1` (CI, on lavapipe's Vulkan) requires
/// everything; `f32` (CI's pass on Mesa's OpenGL) requires an adapter but
/// lets a test of a dtype the adapter lacks skip.
pub fn wgpu_for_test(test: &str) -> Option<Device> {
    wgpu_for_test_in(test, Precision::F32)
}

/// [`wgpu_for_test`] for a test that computes in `precision`: it skips,
/// saying why, on an adapter without that dtype (f16 on Mesa's OpenGL
/// driver).
pub fn wgpu_for_test_in(test: &str, precision: Precision) -> Option<Device> {
    let require = std::env::var("BAPO_REQUIRE_WGPU").unwrap_or_default();
    match ComputeDevice::Wgpu.device_for(precision) {
        Ok(d) => Some(d),
        Err(e @ DeviceError::PrecisionUnsupported { .. }) if require != "1" => {
            eprintln!("{test}: skipped on wgpu: {e}");
            None
        }
        Err(e) if require == "1" || require == "f32" => {
            panic!("{test}: BAPO_REQUIRE_WGPU={require} but {e}")
        }
        Err(e) => {
            eprintln!("{test}: skipped on wgpu: {e}");
            None
        }
    }
}

/// The wgpu device, its adapter's name and its largest buffer, made once
/// per process.
static WGPU: std::sync::OnceLock<Result<(Device, String, u64), DeviceError>> =
    std::sync::OnceLock::new();

/// The wgpu device and a line naming its adapter, started once per
/// process: here, not at the first tensor, so a machine without a usable
/// adapter is refused at start with wgpu's reason instead of a panic
/// mid-run. `WGPU_BACKEND` (wgpu's own variable) pins the graphics API.
#[cfg(feature = "wgpu")]
fn wgpu_device() -> Result<(Device, String), DeviceError> {
    let (device, adapter, _) = WGPU.get_or_init(start_wgpu).clone()?;
    Ok((device, adapter))
}

/// The largest buffer one tensor may have on `device`: on wgpu, the
/// adapter's limit (its storage binding and buffer sizes, the lower:
/// 2 GiB − 4 bytes on NVIDIA's Vulkan driver); `None` elsewhere (the CPU
/// and CUDA allocate whatever memory holds).
pub fn max_buffer_bytes(device: &Device) -> Option<u64> {
    let plain = device.clone().without_autodiff();
    match WGPU.get()? {
        Ok((wgpu, _, max)) if *wgpu == plain => Some(*max),
        _ => None,
    }
}

#[cfg(feature = "wgpu")]
fn start_wgpu() -> Result<(Device, String, u64), DeviceError> {
    let api = graphics_api(std::env::var("WGPU_BACKEND").ok().as_deref())?;
    let (device, setup) = Device::wgpu_options()
        .graphics_api(api)
        .init_with_setup()
        .map_err(|e| DeviceError::Unavailable(e.to_string()))?;
    let info = setup.adapter.get_info();
    let driver: Vec<&str> = [info.driver.as_str(), info.driver_info.as_str()]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect();
    let adapter = format!(
        "{:?} ({:?}, {})",
        info.name,
        setup.backend,
        driver.join(" ")
    );
    let limits = setup.adapter.limits();
    let max_buffer = limits
        .max_storage_buffer_binding_size
        .min(limits.max_buffer_size);
    Ok((device, adapter, max_buffer))
}

/// The graphics API `WGPU_BACKEND` names (as wgpu spells them), or wgpu's
/// own choice when it is unset or empty.
#[cfg(feature = "wgpu")]
fn graphics_api(name: Option<&str>) -> Result<burn::tensor::wgpu::WgpuBackend, DeviceError> {
    use burn::tensor::wgpu::WgpuBackend as Api;
    Ok(
        match name
            .map(str::trim)
            .unwrap_or("")
            .to_ascii_lowercase()
            .as_str()
        {
            "" => Api::Auto,
            "vulkan" => Api::Vulkan,
            "metal" => Api::Metal,
            "dx12" => Api::Dx12,
            "gl" | "opengl" | "gles" => Api::Gl,
            "webgpu" => Api::WebGpu,
            other => return Err(DeviceError::UnknownGraphicsApi(other.to_string())),
        },
    )
}

#[cfg(not(feature = "wgpu"))]
fn wgpu_device() -> Result<(Device, String), DeviceError> {
    Err(DeviceError::NotBuilt("wgpu"))
}

#[cfg(feature = "cuda")]
fn cuda_device() -> Result<Device, DeviceError> {
    Ok(Device::cuda(0))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device() -> Result<Device, DeviceError> {
    Err(DeviceError::NotBuilt("cuda"))
}

/// The member of `all` whose name is `s`, in any case.
fn by_name<T: Copy, const N: usize>(
    all: [T; N],
    name: fn(T) -> &'static str,
    s: &str,
) -> Option<T> {
    all.into_iter().find(|&x| name(x).eq_ignore_ascii_case(s))
}

impl fmt::Display for ComputeDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ComputeDevice {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        by_name(Self::ALL, Self::name, s).ok_or_else(|| DeviceError::Unknown(s.to_string()))
    }
}

/// The dtype the model computes in. Weights are kept (and trained) in f32
/// whatever this says: a lower precision casts them at use, so the
/// optimiser's state and its updates stay exact, and log-probabilities,
/// entropies and the loss are always computed in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    F32,
    Bf16,
    F16,
}

impl Precision {
    pub const ALL: [Precision; 3] = [Self::F32, Self::Bf16, Self::F16];

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        }
    }

    pub fn dtype(self) -> FloatDType {
        match self {
            Self::F32 => FloatDType::F32,
            Self::Bf16 => FloatDType::BF16,
            Self::F16 => FloatDType::F16,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        by_name(Self::ALL, Self::name, s)
            .ok_or_else(|| DeviceError::UnknownPrecision(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_ones_are_named() {
        for d in ComputeDevice::ALL {
            assert_eq!(d.name().parse::<ComputeDevice>().unwrap(), d);
        }
        let err = "tpu".parse::<ComputeDevice>().unwrap_err().to_string();
        assert!(err.contains("\"tpu\""), "{err}");
        assert_eq!("BF16".parse::<Precision>().unwrap(), Precision::Bf16);
        assert!("f8".parse::<Precision>().is_err());
    }

    #[test]
    fn bf16_on_wgpu_is_refused_by_name() {
        let e = ComputeDevice::Wgpu.check(Precision::Bf16).unwrap_err();
        assert!(e.to_string().contains("WGSL has no bf16"), "{e}");
        assert!(ComputeDevice::Wgpu.check(Precision::F16).is_ok());
        assert!(ComputeDevice::Cpu.check(Precision::Bf16).is_ok());
    }

    #[test]
    fn a_backend_not_built_in_is_refused_by_name() {
        for d in ComputeDevice::ALL {
            match d.device() {
                Ok(_) => assert!(d.is_built()),
                Err(DeviceError::Unavailable(why)) => {
                    assert!(d.is_built());
                    eprintln!("{d} is built in but has no adapter here: {why}");
                }
                Err(e) => {
                    assert!(!d.is_built());
                    assert!(e.to_string().contains(&format!("--features {d}")), "{e}");
                }
            }
        }
    }
}
