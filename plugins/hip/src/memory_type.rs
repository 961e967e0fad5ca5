//! `hipPointerAttribute_t` to `PointerKind`, for both numberings of `hipMemoryType`.
//!
//! ROCm 5: Host = 0, Device = 1, Array = 2, Unified = 3.
//! ROCm 6 and later (aligned with CUDA): Unregistered = 0, Host = 1, Device = 2, Managed = 3,
//! Array = 10, Unified = 11.
//! The struct layout is the same; only the meaning of the first field changed, so the runtime's
//! major version (from `hipRuntimeGetVersion`) decides how to read it.

use te_base::device::PointerKind;

/// Classifies one successful `hipPointerGetAttributes` answer.
pub(crate) fn pointer_kind(runtime_major: i32, memory_type: i32, device: i32, is_managed: bool) -> PointerKind {
    if is_managed {
        return PointerKind::Managed;
    }
    let on_device = |device: i32| {
        if device >= 0 {
            PointerKind::Device { device: device as u32 }
        } else {
            PointerKind::Unknown {
                code: memory_type as u32,
            }
        }
    };
    if runtime_major < 6 {
        match memory_type {
            // ROCm 5 only answers for memory it knows, so "host" here is pinned or registered.
            0 => PointerKind::PinnedHost,
            1 => on_device(device),
            3 => PointerKind::Managed,
            code => PointerKind::Unknown { code: code as u32 },
        }
    } else {
        match memory_type {
            0 => PointerKind::Host,
            1 => PointerKind::PinnedHost,
            2 => on_device(device),
            3 => PointerKind::Managed,
            code => PointerKind::Unknown { code: code as u32 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rocm6_numbering() {
        assert_eq!(pointer_kind(6, 0, -1, false), PointerKind::Host);
        assert_eq!(pointer_kind(6, 1, -1, false), PointerKind::PinnedHost);
        assert_eq!(pointer_kind(6, 2, 3, false), PointerKind::Device { device: 3 });
        assert_eq!(pointer_kind(6, 3, 0, false), PointerKind::Managed);
        assert_eq!(pointer_kind(6, 10, 0, false), PointerKind::Unknown { code: 10 });
        assert_eq!(pointer_kind(7, 2, 1, false), PointerKind::Device { device: 1 });
    }

    #[test]
    fn rocm5_numbering() {
        assert_eq!(pointer_kind(5, 0, 0, false), PointerKind::PinnedHost);
        assert_eq!(pointer_kind(5, 1, 2, false), PointerKind::Device { device: 2 });
        assert_eq!(pointer_kind(5, 2, 0, false), PointerKind::Unknown { code: 2 });
        assert_eq!(pointer_kind(5, 3, 0, false), PointerKind::Managed);
    }

    #[test]
    fn the_same_value_means_different_things_across_versions() {
        // 1 is device memory on ROCm 5 and pinned host memory on ROCm 6.
        assert_ne!(pointer_kind(5, 1, 0, false), pointer_kind(6, 1, 0, false));
        // The managed flag wins over the type in both.
        assert_eq!(pointer_kind(5, 1, 0, true), PointerKind::Managed);
        assert_eq!(pointer_kind(6, 2, 0, true), PointerKind::Managed);
        // Device memory without a device ordinal is not guessed.
        assert_eq!(pointer_kind(6, 2, -1, false), PointerKind::Unknown { code: 2 });
    }
}
