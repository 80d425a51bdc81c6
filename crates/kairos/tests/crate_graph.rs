//! docs/ARCHITECTURE.md's crate graph is the one the Cargo.toml files declare: every crate of
//! crates/ has a row, and its kairos dependencies outside tests ([dependencies]) are the row's.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The kairos crates a Cargo.toml's `[dependencies]` section names (without the `kairos-` prefix).
fn declared(manifest: &str) -> BTreeSet<String> {
    let mut in_deps = false;
    let mut out = BTreeSet::new();
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
            continue;
        }
        if in_deps && let Some(rest) = line.strip_prefix("kairos-") {
            let name: String = rest.chars().take_while(|c| c.is_ascii_lowercase()).collect();
            out.insert(name);
        }
    }
    out
}

#[test]
fn the_documented_crate_graph_is_the_declared_one() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut cargo = BTreeMap::new();
    for e in std::fs::read_dir(root.join("crates")).unwrap().flatten() {
        let manifest = e.path().join("Cargo.toml");
        if manifest.exists() {
            let name = e.file_name().to_string_lossy().into_owned();
            cargo.insert(name, declared(&std::fs::read_to_string(manifest).unwrap()));
        }
    }
    assert!(cargo.len() >= 12 && cargo["kairos"].contains("server"), "{cargo:?}");

    let doc = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).unwrap();
    let start = doc.find("| crate | depends on | holds |").expect("ARCHITECTURE.md has the crate graph table");
    let mut documented = BTreeMap::new();
    for line in doc[start..].lines().skip(2).take_while(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let deps: BTreeSet<String> = cells[2].split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect();
        documented.insert(cells[1].to_string(), deps);
    }
    for (name, deps) in &cargo {
        match documented.get(name) {
            None => panic!("crates/{name} has no row in ARCHITECTURE.md's crate graph"),
            Some(d) => assert_eq!(d, deps, "crates/{name}: ARCHITECTURE.md says {d:?}, Cargo.toml says {deps:?}"),
        }
    }
    for name in documented.keys() {
        assert!(cargo.contains_key(name), "ARCHITECTURE.md's crate graph names {name}, which crates/ lacks");
    }
}
