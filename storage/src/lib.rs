//! UMBP: a tiered KV-cache store (DRAM, SSD) built on te-core.
