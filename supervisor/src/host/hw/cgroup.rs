//! dsv4d's own cgroup (the engine runs in it too): how often the kernel's OOM killer has
//! ended a process there.
//!
//! Follows: Documentation/admin-guide/cgroup-v2.rst (`/proc/self/cgroup` has the line
//! `0::PATH` on the unified hierarchy; `memory.events` of that cgroup counts `oom_kill`).
//! Owns: reading the count. Must not: decide what a kill means (the lifecycle does).

use crate::host::sysroot::SysRoot;

/// The `oom_kill` count of this process's cgroup, with the file it came from; `None` where
/// there is no unified hierarchy or no memory controller.
pub fn oom_kills(root: &SysRoot) -> Option<(String, u64)> {
    let text = root.read("/proc/self/cgroup").ok()?;
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?.trim();
    let file = format!(
        "/sys/fs/cgroup{}/memory.events",
        if path == "/" { "" } else { path }
    );
    let events = root.read(&file).ok()?;
    let count = events.lines().find_map(|l| {
        let (key, value) = l.split_once(' ')?;
        (key == "oom_kill").then(|| value.trim().parse().ok())?
    })?;
    Some((file, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_comes_from_this_process_cgroup() {
        let dir = tempfile::tempdir().unwrap();
        let root = SysRoot::new(dir.path()).unwrap();
        assert_eq!(oom_kills(&root), None);
        std::fs::create_dir_all(dir.path().join("proc/self")).unwrap();
        std::fs::write(
            dir.path().join("proc/self/cgroup"),
            "0::/system.slice/dsv4.service\n",
        )
        .unwrap();
        assert_eq!(oom_kills(&root), None);
        let cg = dir.path().join("sys/fs/cgroup/system.slice/dsv4.service");
        std::fs::create_dir_all(&cg).unwrap();
        std::fs::write(
            cg.join("memory.events"),
            "low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n",
        )
        .unwrap();
        assert_eq!(
            oom_kills(&root),
            Some((
                "/sys/fs/cgroup/system.slice/dsv4.service/memory.events".into(),
                2
            ))
        );
    }
}
