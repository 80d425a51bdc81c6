//! How the GPUs of one host are connected: PCIe placement and peer links, as plain data.
//!
//! DeepPlan's parallel transmission (EuroSys'23, section 4.3.3) loads a cold model through several
//! PCIe links at once: the primary GPU (the one that will run the model) and some secondary GPUs
//! each copy a part of the weights host->GPU over their own PCIe link, and the secondaries forward
//! their part to the primary over NVLink. That only pays off when
//! - the secondary reaches the primary over NVLink (forwarding over PCIe would contend for the very
//!   links it means to add), and
//! - the secondary sits behind a different PCIe switch than the primary and than every other
//!   secondary: GPUs behind one switch share its upstream link, so two of them copy no faster than
//!   one. Hence at most as many GPUs take part as there are switches.
//!
//! [`Topology`] holds what a backend found (`kairos_cuda::topology::read` on a real host; tests and
//! the simulator build one by hand), [`Topology::secondaries_for`] makes DeepPlan's choice, and
//! [`Topology::describe`] prints it all (`kairos inspect --gpus`). Nothing here touches a GPU.

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::fmt::Write;

/// The GPUs of one host and the peer links between them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    /// One entry per GPU, in ordinal order.
    pub gpus: Vec<GpuNode>,
    /// One entry per ordered pair of distinct GPUs (`from` -> `to`).
    pub links: Vec<PeerLink>,
}

/// One GPU and where it sits on the PCIe tree.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuNode {
    /// The backend's device ordinal (CUDA's device number).
    pub ordinal: u32,
    /// The product name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// Total device memory.
    pub memory_bytes: u64,
    /// PCI address, `domain:bus:device.function` in lower-case hex as sysfs spells it
    /// (`0000:1b:00.0`).
    pub pci_bus_id: String,
    /// The NUMA node the GPU is attached to; None when the platform does not say.
    pub numa_node: Option<i32>,
    /// An identifier of the PCIe switch the GPU sits behind (the PCI address of the switch's
    /// upstream port): GPUs with equal values share the switch's upstream bandwidth. None when
    /// unknown, e.g. a GPU attached straight to a root port, or a VM that hides the hierarchy.
    pub pcie_switch: Option<String>,
    /// The negotiated PCIe link, e.g. "32.0 GT/s PCIe x16", when known.
    pub pcie_link: Option<String>,
}

/// How one GPU reaches another's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LinkKind {
    /// Peer-to-peer over NVLink.
    NvLink,
    /// Peer-to-peer over PCIe.
    Pcie,
    /// No peer access: copies between the two go through host memory.
    None,
}

impl LinkKind {
    /// The short label of the peer matrix: `NV`, `PCIe` or `-`.
    pub fn label(self) -> &'static str {
        match self {
            LinkKind::NvLink => "NV",
            LinkKind::Pcie => "PCIe",
            LinkKind::None => "-",
        }
    }
}

/// The link from one GPU to another (one per ordered pair: access may differ by direction).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerLink {
    /// The GPU that accesses (ordinal).
    pub from: u32,
    /// The GPU whose memory is accessed (ordinal).
    pub to: u32,
    /// `from` may access `to`'s memory directly.
    pub access: bool,
    /// Atomic operations over the link are native (not emulated).
    pub native_atomics: bool,
    /// The driver's relative performance rank of the link (lower is better, comparable only
    /// between links of one host).
    pub performance_rank: i32,
    /// What the link is.
    pub kind: LinkKind,
}

impl Topology {
    /// The GPU with ordinal `ordinal`, if present.
    pub fn gpu(&self, ordinal: u32) -> Option<&GpuNode> {
        self.gpus.iter().find(|g| g.ordinal == ordinal)
    }

    /// The link from `from` to `to`, if recorded (never for `from == to`).
    pub fn link(&self, from: u32, to: u32) -> Option<&PeerLink> {
        self.links.iter().find(|l| l.from == from && l.to == to)
    }

    /// Whether `a` and `b` reach each other's memory over NVLink, both ways.
    fn nvlink_both_ways(&self, a: u32, b: u32) -> bool {
        let ok = |l: Option<&PeerLink>| l.is_some_and(|l| l.access && l.kind == LinkKind::NvLink);
        ok(self.link(a, b)) && ok(self.link(b, a))
    }

    /// DeepPlan's secondary GPUs for a model whose primary is `primary`: at most `max` GPUs that
    /// could each copy part of the model over their own PCIe link and forward it to the primary.
    ///
    /// A GPU qualifies when it has peer access to and from the primary and both links are NVLink.
    /// Among those, PCIe switches decide:
    /// - a GPU whose switch is known is taken only if its switch differs from the primary's (when
    ///   that is known) and from the switch of every secondary taken so far; so when every switch
    ///   is known, no two chosen GPUs share one and the primary plus its secondaries number at most
    ///   as many as there are switches;
    /// - a GPU whose switch is unknown (None, e.g. a VM that hides the PCIe hierarchy) cannot be
    ///   ruled out, so it is allowed, but ranked after every GPU known to be on a switch of its own:
    ///   they are taken first. Unknown-switch GPUs may therefore share a switch unseen.
    ///
    /// The result is in order of preference (known-different switches first, then unknown ones,
    /// each by ordinal), so its first `k` entries are the best `k`. Empty when `primary` is not in
    /// the topology, has no NVLink peer, or `max` is 0.
    pub fn secondaries_for(&self, primary: u32, max: usize) -> Vec<u32> {
        let Some(p) = self.gpu(primary) else { return Vec::new() };
        let mut candidates: Vec<&GpuNode> =
            self.gpus.iter().filter(|g| g.ordinal != primary && self.nvlink_both_ways(primary, g.ordinal)).collect();
        candidates.sort_by_key(|g| g.ordinal);
        let mut used: BTreeSet<&str> = p.pcie_switch.as_deref().into_iter().collect();
        let mut chosen = Vec::new();
        for g in candidates.iter().filter(|g| g.pcie_switch.is_some()) {
            if chosen.len() >= max {
                return chosen;
            }
            if let Some(s) = g.pcie_switch.as_deref()
                && used.insert(s)
            {
                chosen.push(g.ordinal);
            }
        }
        chosen.extend(candidates.iter().filter(|g| g.pcie_switch.is_none()).map(|g| g.ordinal).take(max - chosen.len()));
        chosen
    }

    /// A human-readable report: one line per GPU (ordinal, name, memory, PCI address, NUMA node,
    /// PCIe switch, PCIe link), the peer matrix (`NV`, `PCIe` or `-` per ordered pair, rows
    /// accessing columns), and per GPU the secondaries [`Topology::secondaries_for`] picks with no
    /// limit.
    pub fn describe(&self) -> String {
        let dash = |o: Option<&str>| o.unwrap_or("-").to_string();
        let name_w = self.gpus.iter().map(|g| g.name.len()).max().unwrap_or(0).max(4);
        let pci_w = self.gpus.iter().map(|g| g.pci_bus_id.len()).max().unwrap_or(0).max(3);
        let sw_w = self.gpus.iter().map(|g| g.pcie_switch.as_deref().map_or(1, str::len)).max().unwrap_or(0).max(6);
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:>3}  {:<name_w$}  {:>10}  {:<pci_w$}  {:>4}  {:<sw_w$}  link",
            "gpu", "name", "memory", "pci", "numa", "switch"
        );
        for g in &self.gpus {
            let _ = writeln!(
                s,
                "{:>3}  {:<name_w$}  {:>6.1} GiB  {:<pci_w$}  {:>4}  {:<sw_w$}  {}",
                g.ordinal,
                g.name,
                g.memory_bytes as f64 / (1u64 << 30) as f64,
                g.pci_bus_id,
                g.numa_node.map_or("-".to_string(), |n| n.to_string()),
                dash(g.pcie_switch.as_deref()),
                dash(g.pcie_link.as_deref()),
            );
        }
        let switches: BTreeSet<&str> = self.gpus.iter().filter_map(|g| g.pcie_switch.as_deref()).collect();
        let unknown = self.gpus.iter().filter(|g| g.pcie_switch.is_none()).count();
        let _ = write!(s, "\n{} GPUs, {} known PCIe switches", self.gpus.len(), switches.len());
        let _ = writeln!(s, "{}", if unknown > 0 { format!(", {unknown} GPUs behind an unknown switch") } else { String::new() });

        let _ = writeln!(s, "\npeer access (row reads column's memory): NV NVLink, PCIe peer-to-peer over PCIe, - none");
        let _ = write!(s, "{:>5}", "");
        for g in &self.gpus {
            let _ = write!(s, "{:>5}", g.ordinal);
        }
        let _ = writeln!(s);
        for a in &self.gpus {
            let _ = write!(s, "{:>5}", a.ordinal);
            for b in &self.gpus {
                let cell = if a.ordinal == b.ordinal {
                    "X"
                } else {
                    self.link(a.ordinal, b.ordinal).map_or("?", |l| if l.access { l.kind.label() } else { "-" })
                };
                let _ = write!(s, "{cell:>5}");
            }
            let _ = writeln!(s);
        }

        let _ = writeln!(
            s,
            "\nsecondaries for parallel transmission (NVLink peers behind other PCIe switches{})",
            if unknown > 0 { "; an unknown switch counts as another, after the known ones" } else { "" }
        );
        for g in &self.gpus {
            let sec = self.secondaries_for(g.ordinal, usize::MAX);
            let list = if sec.is_empty() {
                "none".to_string()
            } else {
                sec.iter().map(|o| o.to_string()).collect::<Vec<_>>().join(", ")
            };
            let _ = writeln!(s, "{:>5} -> {list}", g.ordinal);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(ordinal: u32, switch: Option<&str>) -> GpuNode {
        GpuNode {
            ordinal,
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_bytes: 80 << 30,
            pci_bus_id: format!("0000:{:02x}:00.0", 0x18 + ordinal * 0x10),
            numa_node: Some((ordinal / 4) as i32),
            pcie_switch: switch.map(str::to_string),
            pcie_link: Some("32.0 GT/s PCIe x16".into()),
        }
    }

    /// Every ordered pair, with `kind(from, to)` deciding the link (None: no access).
    fn topology(gpus: Vec<GpuNode>, kind: impl Fn(u32, u32) -> LinkKind) -> Topology {
        let mut links = Vec::new();
        for a in &gpus {
            for b in &gpus {
                if a.ordinal != b.ordinal {
                    let k = kind(a.ordinal, b.ordinal);
                    links.push(PeerLink {
                        from: a.ordinal,
                        to: b.ordinal,
                        access: k != LinkKind::None,
                        native_atomics: k == LinkKind::NvLink,
                        performance_rank: if k == LinkKind::NvLink { 0 } else { 1 },
                        kind: k,
                    });
                }
            }
        }
        Topology { gpus, links }
    }

    /// An HGX H100 board: 8 GPUs all linked by NVLink, two GPUs behind each of 4 PCIe switches.
    fn hgx() -> Topology {
        let switches = ["0000:15:00.0", "0000:3d:00.0", "0000:97:00.0", "0000:bd:00.0"];
        topology((0..8).map(|o| node(o, Some(switches[o as usize / 2]))).collect(), |_, _| LinkKind::NvLink)
    }

    #[test]
    fn hgx_picks_one_gpu_per_other_switch() {
        let t = hgx();
        assert_eq!(t.secondaries_for(0, usize::MAX), vec![2, 4, 6]);
        assert_eq!(t.secondaries_for(1, usize::MAX), vec![2, 4, 6]);
        assert_eq!(t.secondaries_for(3, usize::MAX), vec![0, 4, 6]);
        assert_eq!(t.secondaries_for(7, usize::MAX), vec![0, 2, 4]);
        assert_eq!(t.secondaries_for(5, 2), vec![0, 2]);
        assert_eq!(t.secondaries_for(5, 0), Vec::<u32>::new());
        // Never two on one switch, never the primary's switch: GPUs taking part <= switches.
        for p in 0..8 {
            let sec = t.secondaries_for(p, usize::MAX);
            let mut sw: Vec<_> =
                std::iter::once(p).chain(sec.iter().copied()).map(|o| t.gpu(o).unwrap().pcie_switch.clone()).collect();
            let n = sw.len();
            sw.sort();
            sw.dedup();
            assert_eq!(sw.len(), n, "primary {p}: {sec:?}");
            assert_eq!(n, 4);
        }
        assert_eq!(t.secondaries_for(8, usize::MAX), Vec::<u32>::new(), "no such primary");
    }

    #[test]
    fn pcie_only_pairs_give_no_secondaries() {
        let t = topology((0..4).map(|o| node(o, Some(&format!("sw{o}")))).collect(), |_, _| LinkKind::Pcie);
        for p in 0..4 {
            assert!(t.secondaries_for(p, usize::MAX).is_empty());
        }
        let none = topology((0..2).map(|o| node(o, None)).collect(), |_, _| LinkKind::None);
        assert!(none.secondaries_for(0, usize::MAX).is_empty());
    }

    #[test]
    fn access_missing_one_way_excludes() {
        let mut t = hgx();
        // 2 loses access to 0: 0 must skip it and take 3, the other GPU on 2's switch.
        let l = t.links.iter_mut().find(|l| l.from == 2 && l.to == 0).unwrap();
        l.access = false;
        l.kind = LinkKind::None;
        assert_eq!(t.secondaries_for(0, usize::MAX), vec![3, 4, 6]);
        // 4 reaches 0 only over PCIe one way: excluded too.
        t.links.iter_mut().find(|l| l.from == 0 && l.to == 4).unwrap().kind = LinkKind::Pcie;
        assert_eq!(t.secondaries_for(0, usize::MAX), vec![3, 5, 6]);
        // A link missing from the table counts as no access.
        t.links.retain(|l| !(l.from == 6 && l.to == 0));
        assert_eq!(t.secondaries_for(0, usize::MAX), vec![3, 5, 7]);
    }

    #[test]
    fn unknown_switches_are_allowed_after_known_different_ones() {
        let pair = topology(vec![node(0, None), node(1, None)], |_, _| LinkKind::NvLink);
        assert_eq!(pair.secondaries_for(0, usize::MAX), vec![1]);
        assert_eq!(pair.secondaries_for(1, usize::MAX), vec![0]);
        assert_eq!(pair.secondaries_for(1, 0), Vec::<u32>::new());

        // 1 unknown, 2 on the primary's switch, 3 on another, 4 on the same as 3, 5 unknown.
        let mixed = topology(
            vec![node(0, Some("a")), node(1, None), node(2, Some("a")), node(3, Some("b")), node(4, Some("b")), node(5, None)],
            |_, _| LinkKind::NvLink,
        );
        assert_eq!(mixed.secondaries_for(0, usize::MAX), vec![3, 1, 5]);
        assert_eq!(mixed.secondaries_for(0, 1), vec![3]);
        assert_eq!(mixed.secondaries_for(0, 2), vec![3, 1]);
        // A primary of unknown switch: known ones still never share a switch with each other.
        assert_eq!(mixed.secondaries_for(1, usize::MAX), vec![0, 3, 5]);
    }

    #[test]
    fn describe_has_every_row() {
        let d = hgx().describe();
        let lines: Vec<&str> = d.lines().collect();
        assert!(lines[0].starts_with("gpu  name"), "{d}");
        assert_eq!(
            lines[1], "  0  NVIDIA H100 80GB HBM3    80.0 GiB  0000:18:00.0     0  0000:15:00.0  32.0 GT/s PCIe x16",
            "{d}"
        );
        assert!(lines[8].starts_with("  7  NVIDIA H100 80GB HBM3    80.0 GiB  0000:88:00.0     1  0000:bd:00.0"), "{d}");
        assert!(d.contains("8 GPUs, 4 known PCIe switches\n"), "{d}");
        assert!(d.contains("\n    0    X   NV   NV   NV   NV   NV   NV   NV\n"), "{d}");
        assert!(d.contains("\n    0 -> 2, 4, 6\n"), "{d}");
        assert!(d.contains("\n    7 -> 0, 2, 4\n"), "{d}");

        let mut t = topology(vec![node(0, None), node(1, None), node(2, None)], |a, b| {
            if a + b == 1 { LinkKind::NvLink } else { LinkKind::Pcie }
        });
        t.gpus[2].numa_node = None;
        t.gpus[2].pcie_link = None;
        let d = t.describe();
        assert!(d.contains("3 GPUs, 0 known PCIe switches, 3 GPUs behind an unknown switch"), "{d}");
        assert!(d.contains("\n    1   NV    X PCIe\n"), "{d}");
        assert!(d.contains("\n    2 -> none\n"), "{d}");
        assert!(d.contains("  2  NVIDIA H100 80GB HBM3    80.0 GiB  0000:38:00.0     -  -       -\n"), "{d}");
    }

    #[test]
    fn serde_round_trip() {
        let t = hgx();
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(serde_json::from_str::<Topology>(&json).unwrap(), t);
    }
}
