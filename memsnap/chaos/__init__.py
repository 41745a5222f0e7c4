"""Fault injection into a running Ray job, on a seeded schedule, with a timeline of what landed.

    from memsnap import chaos

    schedule = chaos.Schedule.poisson(mtbf_s=120, kinds=["kill_node", "stall"], nodes=3,
                                      seed=7, horizon_s=600, duration_s=5)
    with chaos.Injector(schedule, cluster=local_cluster, job="train", log="faults.jsonl") as inj:
        train()          # inj.observe_step(step) lets faults land at_step
    inj.events           # one Event per fault landed / ended; chaos.read_log("faults.jsonl")

Modules: ``schedule`` (Fault, Schedule: pure), ``nodes`` (which node a target names),
``hand`` (what a fault does on its node), ``backend`` (carrying faults out on a Ray cluster or
a loopback ``LocalCluster``), ``injector`` (the clock, the thread, the log).
"""

from memsnap.chaos.injector import CONFIRM_HINT, Event, Injector, Timeline, read_log
from memsnap.chaos.schedule import KINDS, PREEMPT_HOW, Fault, Schedule

__all__ = ["Fault", "Schedule", "Injector", "Event", "Timeline", "read_log", "KINDS", "PREEMPT_HOW", "CONFIRM_HINT"]
