"""The named checks of `flare evidence verify`, each a function of the loaded packet, in
families: `packet` (schema, integrity, completeness), `clocks` (clock domains, coalesced
events), `capacity`, `counters`, `agreement` (summary, identities) and `grouping` (group
outcomes, thresholds); `base` holds what they share.

Each check returns a `CheckResult`: a status, a one-line message, its findings (what is
wrong, each naming where) and what it could not evaluate (with why). Statuses:
- `pass`: everything it evaluated holds;
- `fail`: the evidence is intact and shows a violation;
- `inconclusive`: evidence it needs is missing, unreadable or inconsistent in itself;
- `not_run`: an input it needs did not survive an earlier check (counts as inconclusive);
- `not_applicable`: nothing to check (thresholds when none were given).

docs/evidence.md lists every check, its findings and their status.
"""

from flare.evidence.checks.agreement import check_identities, check_summary
from flare.evidence.checks.base import (FAIL, INCONCLUSIVE, MAX_FINDINGS, NOT_APPLICABLE,
                                        NOT_RUN, PASS, CheckResult, Options, Packet, load)
from flare.evidence.checks.capacity import PLAN_KEYS, capacity_label, check_capacity
from flare.evidence.checks.clocks import check_clock_domains, check_coalesced
from flare.evidence.checks.counters import RESTARTED, check_counters, server_lifetimes
from flare.evidence.checks.grouping import check_group_outcomes, check_thresholds
from flare.evidence.checks.packet import check_completeness, check_integrity, check_schema

__all__ = [
    "FAIL", "INCONCLUSIVE", "MAX_FINDINGS", "NOT_APPLICABLE", "NOT_RUN", "PASS", "PLAN_KEYS",
    "RESTARTED", "CheckResult", "Options", "Packet", "capacity_label", "check_capacity",
    "check_clock_domains", "check_coalesced", "check_completeness", "check_counters",
    "check_group_outcomes", "check_identities", "check_integrity", "check_schema",
    "check_summary", "check_thresholds", "load", "server_lifetimes",
]
