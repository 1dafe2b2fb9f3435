//! A validation profile's `matrix:`: the settings `dsv4ctl validate --matrix` compares.
//!
//! `cpu` takes power profiles, `gpu` GPU levels; every other key is an axis of engine
//! argument variants, each a list of arguments added after the profile's own `extra_args`.
//! The cells are every combination, the first axis varying slowest, in the order written.

use dsv4_client::validate::{ArgChoice, CellSettings, Narrowing};
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use super::{CpuPolicy, GpuPolicy};

/// The most cells a matrix may have: at a few minutes a cell on the real box, more is a day.
pub const MAX_CELLS: usize = 64;

/// The power profiles a `cpu` axis may name.
pub const CPU_VALUES: [&str; 3] = ["power-saver", "balanced", "performance"];
/// The GPU levels a `gpu` axis may name.
pub const GPU_VALUES: [&str; 3] = ["auto", "low", "high"];

/// `matrix:`, checked.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Matrix {
    pub axes: Vec<Axis>,
}

/// One axis and its values, in the order written.
#[derive(Debug, Clone, PartialEq)]
pub struct Axis {
    pub name: String,
    pub values: Values,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    Cpu(Vec<String>),
    Gpu(Vec<String>),
    Args(Vec<Vec<String>>),
}

impl Values {
    fn len(&self) -> usize {
        match self {
            Values::Cpu(v) | Values::Gpu(v) => v.len(),
            Values::Args(v) => v.len(),
        }
    }
}

/// The CPU policy a `cpu` value names (one of [`CPU_VALUES`]), read as `power.cpu` reads it.
pub fn cpu_policy(name: &str) -> Option<CpuPolicy> {
    CPU_VALUES.contains(&name).then(|| named(name))?
}

/// The GPU policy a `gpu` value names (one of [`GPU_VALUES`]), read as `power.gpu` reads it.
pub fn gpu_policy(name: &str) -> Option<GpuPolicy> {
    GPU_VALUES.contains(&name).then(|| named(name))?
}

/// The setting `name` names, by the setting's own spelling.
fn named<T: serde::de::DeserializeOwned>(name: &str) -> Option<T> {
    dsv4_yaml::from_str::<T>(name).ok().flatten()
}

impl Matrix {
    /// How many cells the whole matrix has.
    pub fn size(&self) -> usize {
        self.axes.iter().map(|a| a.values.len()).product()
    }

    /// Every cell, after `only` narrowed the axes it names; an error names an axis or a
    /// value that is not there.
    pub fn cells(&self, only: &[Narrowing]) -> Result<Vec<CellSettings>, String> {
        for n in only {
            if !self.axes.iter().any(|a| a.name == n.axis) {
                let known: Vec<&str> = self.axes.iter().map(|a| a.name.as_str()).collect();
                return Err(format!(
                    "the matrix has no axis `{}`; its axes: {}",
                    n.axis,
                    known.join(", ")
                ));
            }
        }
        // Each axis as the (index, value) pairs kept.
        let mut kept: Vec<(&Axis, Vec<usize>)> = Vec::new();
        for axis in &self.axes {
            let wanted: Vec<&String> = only
                .iter()
                .filter(|n| n.axis == axis.name)
                .flat_map(|n| n.values.iter())
                .collect();
            let all: Vec<usize> = (0..axis.values.len()).collect();
            if wanted.is_empty() {
                kept.push((axis, all));
                continue;
            }
            let mut picked = Vec::new();
            for w in wanted {
                let found = all.iter().copied().find(|&i| axis.matches(i, w));
                let Some(i) = found else {
                    return Err(format!(
                        "axis `{}` has no value `{w}`; its values: {}",
                        axis.name,
                        axis.shown().join(", ")
                    ));
                };
                if !picked.contains(&i) {
                    picked.push(i);
                }
            }
            picked.sort_unstable();
            kept.push((axis, picked));
        }
        let mut cells = vec![CellSettings::default()];
        for (axis, picked) in kept {
            let mut next = Vec::with_capacity(cells.len() * picked.len());
            for cell in &cells {
                for &i in &picked {
                    let mut c = cell.clone();
                    match &axis.values {
                        Values::Cpu(v) => c.cpu = Some(v[i].clone()),
                        Values::Gpu(v) => c.gpu = Some(v[i].clone()),
                        Values::Args(v) => c.args.push(ArgChoice {
                            axis: axis.name.clone(),
                            variant: i as u32 + 1,
                            args: v[i].clone(),
                        }),
                    }
                    next.push(c);
                }
            }
            cells = next;
        }
        Ok(cells)
    }
}

impl Axis {
    /// Whether value `i` is the one `asked` names: by name, by number from 1, or by its
    /// arguments joined with spaces.
    fn matches(&self, i: usize, asked: &str) -> bool {
        match &self.values {
            Values::Cpu(v) | Values::Gpu(v) => v[i] == asked,
            Values::Args(v) => asked.parse::<usize>() == Ok(i + 1) || v[i].join(" ") == asked,
        }
    }

    fn shown(&self) -> Vec<String> {
        match &self.values {
            Values::Cpu(v) | Values::Gpu(v) => v.clone(),
            Values::Args(v) => v
                .iter()
                .enumerate()
                .map(|(i, a)| format!("{} [{}]", i + 1, a.join(" ")))
                .collect(),
        }
    }
}

/// `matrix:` as written: its axes in order (a map would sort them).
#[derive(Debug, Default)]
pub(crate) struct RawMatrix(pub Vec<(String, RawValues)>);

#[derive(Debug)]
pub(crate) enum RawValues {
    Names(Vec<String>),
    Args(Vec<Vec<String>>),
}

impl<'de> Deserialize<'de> for RawMatrix {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Axes;
        impl<'de> Visitor<'de> for Axes {
            type Value = RawMatrix;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(
                    "a mapping of axes: `cpu` and `gpu` to lists of names, any other key to a \
                     list of argument lists",
                )
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawMatrix, A::Error> {
                let mut axes = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    if axes.iter().any(|(k, _)| k == &key) {
                        return Err(de::Error::custom(format!("axis `{key}` is given twice")));
                    }
                    let values = match key.as_str() {
                        "cpu" | "gpu" => RawValues::Names(map.next_value()?),
                        _ => RawValues::Args(map.next_value()?),
                    };
                    axes.push((key, values));
                }
                Ok(RawMatrix(axes))
            }
        }
        d.deserialize_map(Axes)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn each_axis_value_names_its_setting() {
        use super::*;
        let cpu: Vec<_> = CPU_VALUES.iter().map(|v| cpu_policy(v)).collect();
        assert_eq!(
            cpu,
            [
                Some(CpuPolicy::PowerSaver),
                Some(CpuPolicy::Balanced),
                Some(CpuPolicy::Performance)
            ]
        );
        let gpu: Vec<_> = GPU_VALUES.iter().map(|v| gpu_policy(v)).collect();
        assert_eq!(
            gpu,
            [
                Some(GpuPolicy::Auto),
                Some(GpuPolicy::Low),
                Some(GpuPolicy::High)
            ]
        );
        // `keep` is a setting, not a cell's value.
        assert_eq!((cpu_policy("keep"), gpu_policy("keep")), (None, None));
    }

    use super::*;

    fn matrix() -> Matrix {
        Matrix {
            axes: vec![
                Axis {
                    name: "cpu".into(),
                    values: Values::Cpu(vec!["power-saver".into(), "performance".into()]),
                },
                Axis {
                    name: "gpu".into(),
                    values: Values::Gpu(vec!["auto".into(), "low".into()]),
                },
                Axis {
                    name: "ub".into(),
                    values: Values::Args(vec![
                        vec!["-ub".into(), "512".into()],
                        vec!["-ub".into(), "2048".into()],
                    ]),
                },
                Axis {
                    name: "load".into(),
                    values: Values::Args(vec![vec![], vec!["--no-mmap".into()]]),
                },
            ],
        }
    }

    fn only(s: &[&str]) -> Vec<Narrowing> {
        s.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn every_combination_first_axis_slowest() {
        let m = matrix();
        assert_eq!(m.size(), 16);
        let cells = m.cells(&[]).unwrap();
        assert_eq!(cells.len(), 16);
        let labels: Vec<String> = cells.iter().map(|c| c.label()).collect();
        assert_eq!(labels[0], "cpu=power-saver gpu=auto ub=[-ub 512] load=[]");
        assert_eq!(
            labels[1],
            "cpu=power-saver gpu=auto ub=[-ub 512] load=[--no-mmap]"
        );
        assert_eq!(labels[2], "cpu=power-saver gpu=auto ub=[-ub 2048] load=[]");
        assert_eq!(
            labels[15],
            "cpu=performance gpu=low ub=[-ub 2048] load=[--no-mmap]"
        );
        // Every cell differs from every other.
        let distinct: std::collections::HashSet<_> = cells.iter().collect();
        assert_eq!(distinct.len(), 16);
    }

    #[test]
    fn narrowing_keeps_the_values_named_in_the_matrix_order() {
        let m = matrix();
        let table: &[(&[&str], Result<usize, &str>)] = &[
            (&["cpu=performance"], Ok(8)),
            (&["cpu=performance,power-saver", "gpu=auto"], Ok(8)),
            (
                &["ub=2", "load=--no-mmap", "gpu=low", "cpu=power-saver"],
                Ok(1),
            ),
            (&["ub=-ub 512"], Ok(8)),
            (&["ub=1,1"], Ok(8)),
            (
                &["fan=on"],
                Err("no axis `fan`; its axes: cpu, gpu, ub, load"),
            ),
            (
                &["gpu=turbo"],
                Err("axis `gpu` has no value `turbo`; its values: auto, low"),
            ),
            (&["ub=3"], Err("its values: 1 [-ub 512], 2 [-ub 2048]")),
        ];
        for (narrow, want) in table {
            let got = m.cells(&only(narrow)).map(|c| c.len());
            match (got, want) {
                (Ok(n), Ok(w)) => assert_eq!(n, *w, "{narrow:?}"),
                (Err(e), Err(w)) => assert!(e.contains(w), "{narrow:?}: {e}"),
                (got, want) => panic!("{narrow:?}: {got:?}, wanted {want:?}"),
            }
        }
        let cells = m.cells(&only(&["cpu=performance,power-saver"])).unwrap();
        assert_eq!(cells[0].cpu.as_deref(), Some("power-saver"), "matrix order");
        let one = &m
            .cells(&only(&["ub=2", "load=2", "gpu=low", "cpu=power-saver"]))
            .unwrap()[0];
        assert_eq!(one.added_args(), vec!["-ub", "2048", "--no-mmap"]);
        assert_eq!(one.args[0].variant, 2);
    }

    #[test]
    fn the_names_are_the_policies() {
        for name in CPU_VALUES {
            assert!(cpu_policy(name).is_some(), "{name}");
        }
        for name in GPU_VALUES {
            assert!(gpu_policy(name).is_some(), "{name}");
        }
        assert_eq!(cpu_policy("keep"), None);
        assert_eq!(gpu_policy("keep"), None);
    }
}
