"""What the scheduling benchmark's workload allows: fcfs, serve's sjf and ideal preemptive
shortest-remaining-first on one seat (M/G/1), simulated over many seeds.

    python benchmarks/scheduling_sim.py                      # 20 seeds, 120 requests each
    python benchmarks/scheduling_sim.py --max-wait-s 60 --preempt-cost-s 0.05

benchmarks/scheduling.py measures a real server on one seeded mix and its seeded Poisson
arrivals, ~20 minutes a seed with one seat. This replays the same mixes and arrivals (its
`make_mix`, its seed conventions, its capacity calibration) against a service model, a
prefill plus a fixed time per output token, so that the spread a goal must survive shows
in seconds: how far each seed's mean E2E under sjf lands from fcfs's, and how often it
meets `--goal`.

Policies, one decode step (`--tpot-s`) at a time:
- fcfs: arrival order, never preempted.
- sjf: serve's rank (serve/scheduler/policy.py): predicted remaining tokens, shrinking
  linearly with the time a request has waited while a later arrival held the seat, to 0
  at `--max-wait-s`; a waiting request whose rank is under `yield_ratio` of the running
  one's takes the seat; each preemption costs `--preempt-cost-s` more service. The
  prediction is the mean length of the request's length class (length_predictor.py's
  buckets), as a well-trained predictor gives, or its `max_tokens` where that is less
  (the mix forces each length with `max_tokens`).
- sjf-age: the same, aging with the time since arrival instead (serve's rule before
  2026-11-26), for comparison.
- srpt: exact remaining service, free preemption, no bound on waiting: the ideal.

Besides each policy's mean E2E against fcfs's, it prints the tail the bound trades for
it: the p99 of the wait for the seat, against fcfs's, and the longest any request was
passed over (waited while a later arrival held the seat).
"""

from __future__ import annotations

import argparse
import bisect
import random
import statistics
from dataclasses import dataclass

import scheduling

from serve.bench.report import latency_stats
from serve.scheduler.length_predictor import BUCKET_EDGES
from serve.scheduler.policy import ShortestJobFirstPolicy

CALIBRATION_REQUESTS = 32  # scheduling.py's --num-calibration in the one-seat runs


@dataclass(frozen=True)
class Job:
    arrival_s: float
    service_s: float
    predicted_tokens: float


def bucket_of(num_tokens: int) -> int:
    """The predictor's length class (its `np.searchsorted(BUCKET_EDGES, ..., "right")`)."""
    return bisect.bisect_right(BUCKET_EDGES, num_tokens)


def make_jobs(args: argparse.Namespace, seed: int) -> list[Job]:
    """The measured mix of scheduling.py with `--seed seed`, arriving at `--load` times
    the capacity its calibration would measure under this service model."""
    mix = scheduling.make_mix(args.num_requests, args, seed=seed)
    calibration = scheduling.make_mix(CALIBRATION_REQUESTS, args, seed=seed + 200)
    capacity = len(calibration) / sum(service_s(k, args) for _, _, k in calibration)
    rate = args.load * capacity
    lengths = [k for _, _, k in mix]
    by_bucket: dict[int, list[int]] = {}
    for k in lengths:
        by_bucket.setdefault(bucket_of(k), []).append(k)
    class_mean = {b: statistics.mean(ks) for b, ks in by_bucket.items()}
    arrivals = random.Random(seed + 1)  # scheduling.py's measured arrivals: seed + 1
    jobs, now = [], 0.0
    for k in lengths:
        jobs.append(Job(now, service_s(k, args), min(class_mean[bucket_of(k)], k)))
        now += arrivals.expovariate(rate)
    return jobs


def service_s(num_tokens: int, args: argparse.Namespace) -> float:
    return args.prefill_s + num_tokens * args.tpot_s


@dataclass
class Outcome:
    e2e_s: list[float]
    first_wait_s: list[float]  # arrival to first holding the seat
    passed_over_s: list[float]  # waiting while a later arrival held the seat


def simulate(jobs: list[Job], policy: str, args: argparse.Namespace) -> Outcome:
    """Each job's latencies on one seat, one decode step at a time."""
    n = len(jobs)
    left = [j.service_s for j in jobs]
    done = [0.0] * n
    first_wait: list[float | None] = [None] * n
    passed_over = [0.0] * n
    waiting: list[int] = []
    running: int | None = None
    now, arrived = 0.0, 0

    def rank(i: int) -> tuple[float, float]:
        job = jobs[i]
        if policy == "fcfs":
            return (job.arrival_s, 0.0)
        if policy == "srpt":
            return (left[i], job.arrival_s)
        generated = (job.service_s - left[i] - args.prefill_s) / args.tpot_s
        remaining = max(1.0, job.predicted_tokens - max(0.0, generated))
        waited = passed_over[i] if policy == "sjf" else now - job.arrival_s
        return (remaining * max(0.0, 1.0 - waited / args.max_wait_s), job.arrival_s)

    while arrived < n or waiting or running is not None:
        while arrived < n and jobs[arrived].arrival_s <= now:
            waiting.append(arrived)
            arrived += 1
        if running is None and not waiting:
            now = jobs[arrived].arrival_s
            continue
        if running is None:
            running = min(waiting, key=rank)
            waiting.remove(running)
        elif waiting and policy != "fcfs":
            best = min(waiting, key=rank)
            ratio = 1.0 if policy == "srpt" else ShortestJobFirstPolicy.yield_ratio
            if rank(best)[0] < ratio * rank(running)[0]:
                if policy != "srpt":
                    left[running] += args.preempt_cost_s
                waiting.append(running)
                waiting.remove(best)
                running = best
        if first_wait[running] is None:
            first_wait[running] = now - jobs[running].arrival_s
        step = min(args.tpot_s, left[running])
        now += step
        left[running] -= step
        for i in waiting:
            if i < running:  # jobs are in arrival order
                passed_over[i] += step
        if left[running] <= 1e-9:
            done[running] = now - jobs[running].arrival_s
            running = None
    return Outcome(done, [w or 0.0 for w in first_wait], passed_over)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20, help="seeds 0 .. N-1")
    p.add_argument("--num-requests", type=int, default=120, help="measured, per seed")
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--short", type=int, nargs=2, default=(2, 8))
    p.add_argument("--long", type=int, nargs=2, default=(150, 250))
    p.add_argument("--tpot-s", type=float, default=1 / 34, help="one seat's decode step")
    p.add_argument("--prefill-s", type=float, default=0.06, help="a chat prompt's prefill")
    p.add_argument("--max-wait-s", type=float, default=30.0, help="sjf's bound")
    p.add_argument("--preempt-cost-s", type=float, default=0.01, help="sjf, per preemption")
    p.add_argument("--goal", type=float, default=1 / 1.5, help="sjf / fcfs mean E2E")
    args = p.parse_args()
    args.lengths = "max_tokens"  # make_mix reads it; the lengths are the mix's own
    return args


def main() -> None:
    args = parse_args()
    policies = ("sjf", "sjf-age", "srpt")
    ratios: dict[str, list[float]] = {p: [] for p in policies}
    tails: dict[str, list[float]] = {p: [] for p in policies}
    passed_over: dict[str, float] = dict.fromkeys(policies, 0.0)
    print(f"{'seed':>4} {'fcfs E2E s':>11}" + "".join(f" {p + '/fcfs':>12}" for p in policies))
    for seed in range(args.seeds):
        jobs = make_jobs(args, seed)
        fcfs = simulate(jobs, "fcfs", args)
        fcfs_first_wait_p99 = latency_stats(fcfs.first_wait_s)["p99"]
        row = []
        for policy in policies:
            outcome = simulate(jobs, policy, args)
            ratios[policy].append(statistics.mean(outcome.e2e_s) / statistics.mean(fcfs.e2e_s))
            p99 = latency_stats(outcome.first_wait_s)["p99"] / fcfs_first_wait_p99
            tails[policy].append(p99)
            passed_over[policy] = max(passed_over[policy], max(outcome.passed_over_s))
            row.append(ratios[policy][-1])
        print(
            f"{seed:>4} {statistics.mean(fcfs.e2e_s):>11.1f}" + "".join(f" {r:>12.3f}" for r in row)
        )
    for policy in policies:
        values = ratios[policy]
        met = sum(r <= args.goal for r in values)
        print(
            f"{policy}: mean E2E / fcfs's {statistics.mean(values):.3f}, range "
            f"{min(values):.3f}-{max(values):.3f}; {met} of {len(values)} seeds at or under "
            f"{args.goal:.3f}; p99 wait for the seat / fcfs's {statistics.mean(tails[policy]):.2f}"
            f" (mean over seeds); longest passed over {passed_over[policy]:.1f} s"
        )


if __name__ == "__main__":
    main()
