//! The checkpoint folder's rules, on real files.

use super::*;
use crate::kv::key::FileId;

fn key(n_ctx: u64) -> Key {
    Key {
        model: FileId {
            size: 100,
            mtime_ns: 1,
            head_sha256: "00".into(),
        },
        mmproj: None,
        n_ctx,
        slots: 1,
        cache_type: "default".into(),
        flash_attn: "default".into(),
        build: "b1".into(),
    }
}

/// A checkpoint of `profile` for `key`, saved at `at`, with one slot file of `bytes` bytes.
fn saved(store: &Store, profile: &str, key: &Key, at: f64, bytes: usize) -> Manifest {
    let id = key.id();
    let file = Store::slot_file_name(&id, at as u64, 0);
    fs::write(store.dir().join(&file), vec![7u8; bytes]).unwrap();
    let m = Manifest {
        format: FORMAT,
        id,
        profile: profile.into(),
        key: key.clone(),
        saved_at: at,
        save_seconds: 0.1,
        slots: vec![SlotFile {
            slot: 0,
            file,
            tokens: 10,
            bytes: bytes as u64,
        }],
        aside: None,
    };
    store.commit(&m).unwrap();
    m
}

fn store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::new(&dir.path().join("kv"));
    store.ensure().unwrap();
    (dir, store)
}

#[test]
fn the_checkpoint_of_the_key_is_found_and_others_are_left_alone() {
    let (_d, store) = store();
    let mine = saved(&store, "320k", &key(4096), 10.0, 100);
    // Another profile's checkpoint for another engine shares the folder.
    let theirs = saved(&store, "64k", &key(1024), 20.0, 50);
    let found = store.lookup("320k", &key(4096));
    assert_eq!(found.found.as_ref(), Some(&mine));
    assert!(found.set_aside.is_empty(), "{:?}", found.set_aside);
    assert_eq!(store.lookup("64k", &key(1024)).found, Some(theirs));
    assert_eq!(store.list().len(), 2);
}

#[test]
fn a_checkpoint_of_the_profile_for_another_engine_is_set_aside_with_the_reason() {
    let (_d, store) = store();
    saved(&store, "320k", &key(4096), 10.0, 100);
    let found = store.lookup("320k", &key(2048));
    assert!(found.found.is_none());
    assert_eq!(found.set_aside.len(), 1);
    assert!(
        found.set_aside[0].contains("context per slot 4096 (now 2048)"),
        "{:?}",
        found.set_aside
    );
    // Never offered again, and shown as set aside.
    assert!(store.lookup("320k", &key(4096)).found.is_none());
    let list = store.list();
    assert_eq!(list.len(), 1);
    assert!(list[0].aside.as_deref().unwrap().contains("context"));
}

#[test]
fn the_checkpoint_a_start_would_restore_is_the_current_one() {
    let (_d, store) = store();
    assert_eq!(store.current(&key(4096)), None);
    let m = saved(&store, "320k", &key(4096), 10.0, 100);
    assert_eq!(store.current(&key(4096)), Some(m.clone()));
    assert_eq!(store.current(&key(2048)), None);
    // One a start would set aside is not.
    fs::write(store.dir().join(&m.slots[0].file), vec![7u8; 60]).unwrap();
    assert_eq!(store.current(&key(4096)), None);
}

#[test]
fn a_truncated_or_interrupted_checkpoint_is_set_aside() {
    let (_d, store) = store();
    let m = saved(&store, "320k", &key(4096), 10.0, 100);
    fs::write(store.dir().join(&m.slots[0].file), vec![7u8; 60]).unwrap();
    let found = store.lookup("320k", &key(4096));
    assert!(found.found.is_none());
    assert!(
        found.set_aside[0].contains("truncated"),
        "{:?}",
        found.set_aside
    );

    let m = saved(&store, "320k", &key(4096), 11.0, 100);
    store.mark_restoring(&m.id).unwrap();
    let found = store.lookup("320k", &key(4096));
    assert!(found.found.is_none());
    assert!(
        found.set_aside[0].contains("never ended"),
        "{:?}",
        found.set_aside
    );

    // A damaged manifest too.
    fs::write(store.dir().join(format!("{}.json", key(8192).id())), b"{").unwrap();
    let found = store.lookup("320k", &key(8192));
    assert!(
        found.set_aside[0].contains("damaged"),
        "{:?}",
        found.set_aside
    );
    assert!(!store
        .dir()
        .join(format!("{}.json", key(8192).id()))
        .exists());
}

#[test]
fn a_new_save_replaces_the_old_files_of_its_key() {
    let (_d, store) = store();
    let old = saved(&store, "320k", &key(4096), 10.0, 100);
    let new = saved(&store, "320k", &key(4096), 12.0, 120);
    assert!(!store.dir().join(&old.slots[0].file).exists());
    assert!(store.dir().join(&new.slots[0].file).exists());
    assert_eq!(store.lookup("320k", &key(4096)).found, Some(new));
}

#[test]
fn eviction_takes_set_aside_then_oldest_and_keeps_the_new_one() {
    let (_d, store) = store();
    let a = saved(&store, "a", &key(1024), 1.0, 1000);
    let b = saved(&store, "b", &key(2048), 2.0, 1000);
    let c = saved(&store, "c", &key(4096), 3.0, 1000);
    store.set_aside(&b, "test").unwrap();
    let total = store.total_bytes();
    assert!(total > 3000, "{total}");
    // Room for two slot files and their manifests: the set-aside one goes first.
    let gone = store.evict_to(2000 + 2 * 1024, &c.id);
    assert_eq!(gone.len(), 1, "{gone:?}");
    assert!(gone[0].contains(&b.id));
    // Room for one: the oldest other than the new one goes.
    let gone = store.evict_to(1500, &c.id);
    assert_eq!(gone.len(), 1, "{gone:?}");
    assert!(gone[0].contains(&a.id));
    assert_eq!(store.list(), vec![c.clone()]);
    // Nothing else to evict: the kept one stays even over the bound.
    assert!(store.evict_to(10, &c.id).is_empty());
    assert_eq!(store.evict_oldest(&c.id), None);
}

#[test]
fn sweep_and_drop_remove_only_files_of_the_layout() {
    let (_d, store) = store();
    let a = saved(&store, "a", &key(1024), 1.0, 10);
    let b = saved(&store, "b", &key(2048), 2.0, 10);
    let orphan = Store::slot_file_name(&a.id, 99, 0);
    fs::write(store.dir().join(&orphan), b"x").unwrap();
    fs::write(store.dir().join("notes.txt"), b"mine").unwrap();
    store.sweep();
    assert!(!store.dir().join(&orphan).exists());
    assert!(store.dir().join(&a.slots[0].file).exists());
    assert_eq!(store.drop_matching("a"), vec![a.id.clone()]);
    assert_eq!(store.list(), vec![b.clone()]);
    assert_eq!(store.drop_matching(&b.id), vec![b.id.clone()]);
    saved(&store, "c", &key(4096), 3.0, 10);
    assert_eq!(store.drop_matching("all").len(), 1);
    assert!(store.list().is_empty());
    assert!(store.dir().join("notes.txt").exists(), "not ours: kept");
}
