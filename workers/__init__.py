"""The fused worker and its roles (``fusedrl.workers``). Engine imports happen inside the roles."""
