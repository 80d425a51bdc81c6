//! The README's table "Environment variables" lists every `KAIROS_` and `CUDA_` variable a source
//! of the workspace reads (`env::var("..")`, `env::var_os("..")`, or a settings table's
//! `name: ".."`), and names no variable that nothing reads. Variables of options (clap's
//! `env = ".."`) are named by `--help` and are not in the table.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "target" && n != "fuzz_corpus") {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every string literal that directly follows `prefix` in `text`, if it looks like a variable name.
fn names_after(text: &str, prefix: &str, names: &mut Vec<String>) {
    for (i, _) in text.match_indices(prefix) {
        let rest = &text[i + prefix.len()..];
        let name: String = rest.chars().take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_').collect();
        if (name.starts_with("KAIROS_") || name.starts_with("CUDA_")) && rest[name.len()..].starts_with('"') {
            names.push(name);
        }
    }
}

#[test]
fn the_readme_table_lists_every_variable_read() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = Vec::new();
    rust_files(&root.join("crates"), &mut files);
    assert!(files.len() > 100, "found only {} sources under {}", files.len(), root.display());
    let mut read = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for prefix in ["env::var(\"", "env::var_os(\"", "EnvVar { name: \"", "flag(\""] {
            names_after(&text, prefix, &mut read);
        }
    }
    read.sort();
    read.dedup();
    for must in ["KAIROS_CACHE_DIR", "KAIROS_LAUNCH_THREADS", "KAIROS_SPLIT_K", "KAIROS_SEED", "KAIROS_DATA_DIR"] {
        assert!(read.iter().any(|n| n == must), "the scan missed {must}: {read:?}");
    }

    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let start = readme.find("## Environment variables").expect("README has a section \"Environment variables\"");
    let section = &readme[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
    let mut listed = Vec::new();
    for line in section.lines().filter(|l| l.starts_with("| `")) {
        let first = line.split('|').nth(1).unwrap();
        for part in first.split('`').skip(1).step_by(2) {
            listed.push(part.to_string());
        }
    }
    let missing: Vec<_> = read.iter().filter(|n| !listed.contains(n)).collect();
    assert!(missing.is_empty(), "read by a source but not in the README's table: {missing:?}");
    // The table's build-time and script variables are read by build scripts or shell scripts.
    let scripts: String = ["scripts/build-release.sh", "crates/kairos/build.rs"]
        .iter()
        .map(|p| std::fs::read_to_string(root.join(p)).unwrap())
        .collect();
    let stale: Vec<_> =
        listed.iter().filter(|n| !read.contains(n) && !scripts.contains(n.as_str()) && n.as_str() != "RUST_LOG").collect();
    assert!(stale.is_empty(), "in the README's table but read nowhere: {stale:?}");
}
