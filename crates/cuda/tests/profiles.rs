//! The committed GPU profiles (data/profiles/<device>/) load and are self-consistent.

use kairos_gpu::profile::ProfileSet;
use std::path::Path;

#[test]
fn committed_profiles_load_and_are_consistent() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/profiles");
    // The repository ships them (data/profiles/h100-sxm, ...): a missing folder is a failure.
    let devices = std::fs::read_dir(&root).unwrap_or_else(|e| panic!("no profiles under {}: {e}", root.display()));
    let mut models = 0;
    for dev in devices.flatten() {
        let set = ProfileSet::load_dir(&dev.path()).unwrap();
        for m in &set.models {
            models += 1;
            assert!(!m.kernels.is_empty(), "{}: no kernels", m.model);
            assert!(m.latency_ns > 0, "{}: no latency", m.model);
            for (i, k) in m.kernels.iter().enumerate() {
                assert_eq!(k.launch as usize, i, "{}: launches out of order", m.model);
                assert!(k.duration_ns > 0 && k.ctas_per_sm_max > 0, "{} launch {i}: {k:?}", m.model);
                assert!(k.min_sms >= 1 && k.min_sms <= m.sm_count, "{} launch {i}: min_sms {}", m.model, k.min_sms);
                assert!(
                    k.duration_by_sms.iter().any(|(s, _)| *s == k.min_sms),
                    "{} launch {i}: min_sms not among the sizes tried",
                    m.model
                );
                assert!(k.occupancy > 0.0 && k.occupancy <= 1.0, "{} launch {i}: occupancy {}", m.model, k.occupancy);
            }
        }
    }
    assert!(models > 0, "no profile under {}", root.display());
    println!("{models} committed profiles checked");
}

/// The batch-8/16/32 profiles (data/profiles/h200-batches, `kairos profile --batch N`, no
/// autotuning) match the plans today's lowering makes at those batches (a profile of other
/// launches is dropped at load as stale), checked on the models quickest to lower; so do the
/// H200's bert_base profile (re-measured 2026-11-30) and distilbert's, made from it by
/// scripts/profile_from_identical_kernels.py.
#[test]
fn profiles_of_todays_lowering_match_its_plans() {
    use kairos_ir::DType;
    use kairos_ir::model::ModelSpec;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/profiles");
    let batches = ProfileSet::load_dir(&root.join("h200-batches")).unwrap();
    let h200 = ProfileSet::load_dir(&root.join("h200")).unwrap();
    let mut checked = 0;
    for (set, model, batch) in [
        (&batches, "squeezenet1_1", 8),
        (&batches, "squeezenet1_1", 16),
        (&batches, "squeezenet1_1", 32),
        (&batches, "resnet18", 16),
        (&h200, "bert_base", 1),
        (&h200, "distilbert", 1),
    ] {
        let p = set.find(model, DType::F16, batch).unwrap_or_else(|| panic!("no {model}@b{batch} under {}", root.display()));
        let plan = ModelSpec { batch, dtype: DType::F16, ..ModelSpec::new(model) }.plan().unwrap();
        p.check_plan(&plan).unwrap_or_else(|e| panic!("{model}@b{batch}: {e}"));
        assert_eq!(p.batch, batch);
        checked += 1;
    }
    assert_eq!(checked, 6);
}
