//! Reads the host's multi-GPU topology ([`kairos_gpu::topology::Topology`]) from the CUDA driver
//! and sysfs: names, memory and PCI addresses from the driver, peer access and link attributes per
//! ordered pair from the driver, NUMA node, PCIe link and PCIe switch from
//! `/sys/bus/pci/devices/<address>`. Missing sysfs entries (another OS, a container without
//! /sys, a VM that hides the PCIe tree) leave those fields None; they are never an error.
//!
//! The sysfs parsing lives in pure functions ([`switch_of_sysfs_path`], [`link_description`],
//! [`parse_numa_node`], [`normalize_pci_bus_id`]) so that it is tested without a GPU.

use crate::driver::{self, CUdevice_P2PAttribute as P2P, DriverError};
use kairos_gpu::GpuError;
use kairos_gpu::topology::{GpuNode, LinkKind, PeerLink, Topology};
use std::path::Path;

fn drv(e: DriverError) -> GpuError {
    GpuError::Driver(e.to_string())
}

/// Where sysfs keeps one directory per PCI device.
const SYSFS_PCI_DEVICES: &str = "/sys/bus/pci/devices";

/// The GPUs the driver sees and the links between every ordered pair of them.
///
/// Without the driver library, a usable driver or any GPU this is [`GpuError::NoDevice`], never a
/// panic; a driver call failing later is [`GpuError::Driver`].
pub fn read() -> Result<Topology, GpuError> {
    if !driver::is_present() {
        return Err(GpuError::NoDevice("the NVIDIA driver library (libcuda) is not installed on this machine".into()));
    }
    driver::init().map_err(|e| GpuError::NoDevice(format!("{e}: no usable NVIDIA GPU")))?;
    let count = driver::device_count().map_err(drv)?;
    if count <= 0 {
        return Err(GpuError::NoDevice("the NVIDIA driver sees no GPU".into()));
    }
    let devices = (0..count).map(driver::device_get).collect::<Result<Vec<_>, _>>().map_err(drv)?;
    let mut gpus = Vec::with_capacity(devices.len());
    for (ordinal, &dev) in devices.iter().enumerate() {
        let pci_bus_id = normalize_pci_bus_id(&driver::device_pci_bus_id(dev).map_err(drv)?);
        let sysfs = Path::new(SYSFS_PCI_DEVICES).join(&pci_bus_id);
        let read_attr = |name: &str| std::fs::read_to_string(sysfs.join(name)).ok();
        gpus.push(GpuNode {
            ordinal: ordinal as u32,
            name: driver::device_name(dev).map_err(drv)?,
            memory_bytes: driver::device_total_mem(dev).map_err(drv)?,
            numa_node: read_attr("numa_node").as_deref().and_then(parse_numa_node),
            pcie_switch: std::fs::canonicalize(&sysfs).ok().and_then(|p| switch_of_sysfs_path(&p)),
            pcie_link: link_description(read_attr("current_link_speed").as_deref(), read_attr("current_link_width").as_deref()),
            pci_bus_id,
        });
    }
    let mut links = Vec::new();
    for (from, &src) in devices.iter().enumerate() {
        for (to, &dst) in devices.iter().enumerate() {
            if from != to {
                links.push(read_link(src, dst, from as u32, to as u32)?);
            }
        }
    }
    Ok(Topology { gpus, links })
}

/// The link from `src` to `dst` as the driver reports it.
///
/// The link's kind is a heuristic, since the driver API does not name the interconnect: access
/// with native atomics is taken as NVLink, access without them as PCIe. It holds on the boards
/// kairos targets (H100/H200 SXM in HGX systems), where peer-to-peer atomics are native only over
/// NVLink and PCIe peer access (when enabled at all) has none; a platform with native PCIe atomics
/// between GPUs would be reported as NVLink. `nvidia-smi topo -m` is the check.
fn read_link(src: driver::CUdevice, dst: driver::CUdevice, from: u32, to: u32) -> Result<PeerLink, GpuError> {
    let attr = |a: P2P| driver::device_p2p_attribute(a, src, dst).map_err(drv);
    let access =
        driver::device_can_access_peer(src, dst).map_err(drv)? && attr(P2P::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED)? != 0;
    let (native_atomics, performance_rank) = if access {
        (attr(P2P::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)? != 0, attr(P2P::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)?)
    } else {
        (false, 0)
    };
    Ok(PeerLink { from, to, access, native_atomics, performance_rank, kind: link_kind(access, native_atomics) })
}

/// The link kind heuristic of [`read_link`]: access and native atomics => NVLink, access alone =>
/// PCIe, no access => none.
pub fn link_kind(access: bool, native_atomics: bool) -> LinkKind {
    match (access, native_atomics) {
        (true, true) => LinkKind::NvLink,
        (true, false) => LinkKind::Pcie,
        (false, _) => LinkKind::None,
    }
}

/// A PCI address as sysfs names it: lower-case hex, the domain in 4 digits unless it needs more
/// (the driver may write `0000:1B:00.0` or `00000000:1B:00.0`; sysfs has `0000:1b:00.0`).
pub fn normalize_pci_bus_id(id: &str) -> String {
    let id = id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 && domain.bytes().all(|b| b.is_ascii_hexdigit()) => {
            let trimmed = domain.trim_start_matches('0');
            format!("{trimmed:0>4}:{rest}")
        }
        _ => id,
    }
}

/// Whether a path component is a PCI address, `dddd:bb:dd.f` (the domain may be longer).
fn is_pci_address(s: &str) -> bool {
    let Some((head, function)) = s.rsplit_once('.') else { return false };
    let parts: Vec<&str> = head.split(':').collect();
    let hex = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_hexdigit());
    parts.len() == 3
        && parts[0].len() >= 4
        && parts[1].len() == 2
        && parts[2].len() == 2
        && parts.iter().all(|p| hex(p))
        && function.len() == 1
        && hex(function)
}

/// The PCIe switch a device sits behind, from the canonical sysfs path of the device, e.g.
/// `/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0`.
///
/// After the host bridge (`pci0000:00`, the root complex) the path names the chain of PCI devices
/// down to the GPU: the root port (`0000:00:01.0`, part of the root complex), then any bridges,
/// then the device. A PCIe switch shows as two bridges, its upstream port and the downstream port
/// the device hangs from; so when at least two bridges lie between the root port and the device,
/// the one two levels above the device is the upstream port of the nearest switch, and its address
/// identifies the switch (`0000:01:00.0` above). With fewer (a device on a root port, or the flat
/// tree a VM shows) the answer is None: no switch, or none visible. Behind nested switches this is
/// the innermost one. Where a path holds several host bridges (e.g. Intel VMD domains), the chain
/// starts after the last.
pub fn switch_of_sysfs_path(path: &Path) -> Option<String> {
    let components: Vec<&str> = path.components().filter_map(|c| c.as_os_str().to_str()).collect();
    let root = components.iter().rposition(|c| c.starts_with("pci"))?;
    let chain = &components[root + 1..];
    if chain.is_empty() || !chain.iter().all(|c| is_pci_address(c)) {
        return None;
    }
    // chain = [root port, bridges.., device].
    let bridges = chain.len().saturating_sub(2);
    if bridges >= 2 { Some(chain[chain.len() - 3].to_string()) } else { None }
}

/// The PCIe link from sysfs's `current_link_speed` ("32.0 GT/s PCIe", or "16 GT/s" on older
/// kernels) and `current_link_width` ("16"): "32.0 GT/s PCIe x16". None without a known speed.
pub fn link_description(speed: Option<&str>, width: Option<&str>) -> Option<String> {
    let speed = speed.map(str::trim).filter(|s| !s.is_empty() && !s.to_ascii_lowercase().contains("unknown"))?;
    match width.map(str::trim).filter(|w| !w.is_empty() && *w != "0") {
        Some(w) => Some(format!("{speed} x{w}")),
        None => Some(speed.to_string()),
    }
}

/// sysfs's `numa_node` ("0\n"; "-1" when the platform has no NUMA information): None for -1,
/// anything negative, or text that is not a number.
pub fn parse_numa_node(text: &str) -> Option<i32> {
    text.trim().parse::<i32>().ok().filter(|&n| n >= 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn switch(path: &str) -> Option<String> {
        switch_of_sysfs_path(Path::new(path))
    }

    #[test]
    fn switch_is_the_upstream_port_two_levels_above() {
        assert_eq!(
            switch("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0").as_deref(),
            Some("0000:01:00.0")
        );
        // Two GPUs on two downstream ports of one switch: same switch.
        assert_eq!(
            switch("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:04:00.0").as_deref(),
            Some("0000:01:00.0")
        );
        // Nested switches (as on HGX boards): the innermost one.
        assert_eq!(
            switch("/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0/0000:19:00.0/0000:1b:00.0")
                .as_deref(),
            Some("0000:18:00.0")
        );
        // VMD: the chain starts after the last host bridge.
        assert_eq!(
            switch("/sys/devices/pci0000:00/0000:00:0e.0/pci10000:e0/10000:e0:06.0/10000:e1:00.0/10000:e2:00.0/10000:e3:00.0")
                .as_deref(),
            Some("10000:e1:00.0")
        );
    }

    #[test]
    fn no_switch_without_two_bridges_below_the_root_port() {
        // Straight on a root port.
        assert_eq!(switch("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0"), None);
        // A root port and one bridge.
        assert_eq!(switch("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0"), None);
        // A VM's flat tree: the GPU on the host bridge.
        assert_eq!(switch("/sys/devices/pci0000:00/0000:00:05.0"), None);
        // Not a PCI path at all.
        assert_eq!(switch("/sys/devices/platform/foo/bar/baz/qux"), None);
        assert_eq!(switch("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/virtual/0000:03:00.0"), None);
        assert_eq!(switch(""), None);
    }

    #[test]
    fn pci_bus_ids_match_sysfs() {
        assert_eq!(normalize_pci_bus_id("0000:1B:00.0"), "0000:1b:00.0");
        assert_eq!(normalize_pci_bus_id("00000000:1B:00.0\n"), "0000:1b:00.0");
        assert_eq!(normalize_pci_bus_id("00010000:E1:00.0"), "10000:e1:00.0");
        assert_eq!(normalize_pci_bus_id("0000:c3:00.0"), "0000:c3:00.0");
        assert!(is_pci_address("0000:c3:00.0"));
        assert!(is_pci_address("10000:e1:00.0"));
        assert!(!is_pci_address("pci0000:00"));
        assert!(!is_pci_address("0000:c3:00"));
        assert!(!is_pci_address("0000:c3:0g.0"));
    }

    #[test]
    fn link_and_numa_from_sysfs_text() {
        assert_eq!(link_description(Some("32.0 GT/s PCIe\n"), Some("16\n")).as_deref(), Some("32.0 GT/s PCIe x16"));
        assert_eq!(link_description(Some("16 GT/s"), None).as_deref(), Some("16 GT/s"));
        assert_eq!(link_description(Some("8.0 GT/s PCIe"), Some("0")).as_deref(), Some("8.0 GT/s PCIe"));
        assert_eq!(link_description(Some("Unknown"), Some("16")), None);
        assert_eq!(link_description(None, Some("16")), None);
        assert_eq!(parse_numa_node("1\n"), Some(1));
        assert_eq!(parse_numa_node("-1\n"), None);
        assert_eq!(parse_numa_node(""), None);
    }

    #[test]
    fn link_kinds() {
        assert_eq!(link_kind(true, true), LinkKind::NvLink);
        assert_eq!(link_kind(true, false), LinkKind::Pcie);
        assert_eq!(link_kind(false, true), LinkKind::None);
        assert_eq!(link_kind(false, false), LinkKind::None);
    }

    /// On a GPU machine: the topology reads, lists every GPU and every ordered pair, and
    /// describes itself.
    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
    fn reads_this_host() {
        let t = match read() {
            Ok(t) => t,
            Err(e) => panic!("the topology did not read: {e}"),
        };
        let n = t.gpus.len();
        assert!(n >= 1);
        assert_eq!(t.links.len(), n * (n - 1));
        for (i, g) in t.gpus.iter().enumerate() {
            assert_eq!(g.ordinal as usize, i);
            assert!(g.memory_bytes > 0 && !g.name.is_empty() && is_pci_address(&g.pci_bus_id), "{g:?}");
        }
        eprintln!("{}", t.describe());
    }
}
