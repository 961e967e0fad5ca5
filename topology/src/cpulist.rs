//! The kernel's CPU list format (`0-47,96-143`), used by NUMA nodes and PCI devices.

use std::fmt;

use serde::{Serialize, Serializer};

/// A set of CPU numbers as the kernel lists them in `cpulist` files.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CpuList(Vec<u32>);

impl CpuList {
    /// Parses `0-3,8,10-11`; an empty (or whitespace-only) text is the empty set.
    pub fn parse(text: &str) -> Result<CpuList, String> {
        let text = text.trim();
        let mut cpus = Vec::new();
        if text.is_empty() {
            return Ok(CpuList(cpus));
        }
        for part in text.split(',') {
            let num = |t: &str| t.parse::<u32>().map_err(|_| format!("malformed CPU list {text:?}"));
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (num(a)?, num(b)?);
                    if b < a || b - a > 1 << 16 {
                        return Err(format!("malformed CPU range {part:?} in {text:?}"));
                    }
                    cpus.extend(a..=b);
                }
                None => cpus.push(num(part)?),
            }
        }
        cpus.sort_unstable();
        cpus.dedup();
        Ok(CpuList(cpus))
    }

    /// The CPUs, ascending.
    pub fn cpus(&self) -> &[u32] {
        &self.0
    }

    /// Number of CPUs.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when no CPU is listed.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for CpuList {
    /// Prints the compact kernel form, `0-47,96-143`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut i = 0;
        let mut first = true;
        while i < self.0.len() {
            let start = self.0[i];
            let mut end = start;
            while i + 1 < self.0.len() && self.0[i + 1] == end + 1 {
                i += 1;
                end += 1;
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if start == end {
                write!(f, "{start}")?;
            } else {
                write!(f, "{start}-{end}")?;
            }
            i += 1;
        }
        Ok(())
    }
}

impl Serialize for CpuList {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let l = CpuList::parse("0-47,96-143\n").unwrap();
        assert_eq!(l.len(), 96);
        assert_eq!(l.to_string(), "0-47,96-143");
        assert_eq!(CpuList::parse("3,1,2").unwrap().to_string(), "1-3");
        assert!(CpuList::parse("").unwrap().is_empty());
        for bad in ["a", "3-1", "1-", ",", "1,,2"] {
            assert!(CpuList::parse(bad).is_err(), "{bad}");
        }
    }
}
