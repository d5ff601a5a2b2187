"""`-name python`: any script, any roles, run with the interpreter paicli runs on.

The launcher-only adapter: it proves the core without a framework. Roles come
from -Dcluster as written; roles named `ps` are services (stopped once the
others finish), every other role must finish.
"""

from __future__ import annotations

import sys

from paicli.adapters.base import Adapter, StagedCode, cluster_roles, code_inputs, script_args
from paicli.jobplan import JobPlan, RolePlan
from paicli.spec import JobSpec

SERVICE_ROLES = ("ps",)


class PythonAdapter(Adapter):
    name = "python"
    aliases = ("py", "python3")
    task_name = "PythonTask"

    def plan(self, spec: JobSpec, code: StagedCode) -> JobPlan:
        argv = [sys.executable, "-u", str(code.entry), *script_args(spec)]
        roles = [RolePlan(name=role, count=conf["count"], argv=argv, cwd=str(code.cwd),
                          must_finish=role not in SERVICE_ROLES, cpu=conf["cpu"], memory=conf["memory"],
                          gpu=conf["gpu"] or (spec.get("gpuRequired") if role not in SERVICE_ROLES else 0))
                 for role, conf in cluster_roles(spec, {"worker": {"count": 1}}).items()]
        # Services start first so that workers find them listening sooner.
        roles.sort(key=lambda r: r.must_finish)
        return self.job_plan(spec, code.entry.stem, roles, inputs=code_inputs(code))
