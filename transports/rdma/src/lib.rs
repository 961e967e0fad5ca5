//! RDMA verbs transport (RoCE / InfiniBand).
