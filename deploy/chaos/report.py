"""What a chaos run found: faults injected, requests failed, retried or wrong, pages
leaked or owned twice, leases outlived, and how long the index took to agree with the
nodes; `ok` is the bar a run passes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ChaosReport:
    seed: int
    faults_injected: int
    fault_attempts: int  # injections tried; the extra ones found nothing to act on
    requests: int
    failed_requests: int
    retried_requests: int  # by the client: the app failed a request it should have served
    app_retried_requests: int  # by the app, on another replica (a replica's node died)
    wrong_outputs: int
    leaked_pages: int
    double_owned_pages: int
    expired_leases_unreleased: int
    index_converged_s: float  # from the last fault until the index agreed with every node
    workload_drained_s: float  # of that, until the workload's last requests had ended
    leaked_staging_files: int  # vLLM engines': files in /dev/shm no running engine owns
    wall_s: float
    by_kind: dict = field(default_factory=dict)

    def ok(self, faults: int | None = None, converge_limit_s: float = 5.0) -> bool:
        """Every count zero, the index converged in time, and (given `faults`) all injected."""
        return (
            not (
                self.failed_requests
                or self.retried_requests
                or self.wrong_outputs
                or self.leaked_pages
                or self.double_owned_pages
                or self.expired_leases_unreleased
                or self.leaked_staging_files
            )
            and self.index_converged_s <= converge_limit_s
            and (faults is None or self.faults_injected == faults)
        )
