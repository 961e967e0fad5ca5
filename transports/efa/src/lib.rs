//! libfabric transport (EFA on AWS; tcp;ofi_rxm and shm providers elsewhere).
