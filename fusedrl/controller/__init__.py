"""The single controller's plumbing: resource pools and worker groups."""

from fusedrl.controller.worker_group import ResourcePool, WorkerDiedError, WorkerGroup, WorkerTimeoutError

__all__ = ["ResourcePool", "WorkerDiedError", "WorkerGroup", "WorkerTimeoutError"]
