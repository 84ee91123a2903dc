"""The training loop. One process = one rank; the loop is the same for every algorithm.

The cross-cluster algorithm is an object wrapped around the loop (`edit_train.local_sgd.sync.algorithms`):
it sees the gradients after backward (synchronous warm-up), the step boundary (sync decisions) and the
forward pass (layer-wise sync hooks). Everything else here is plain training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from edit_train.config import Config, outer_step, to_container, validate
from edit_train.data.loader import TokenLoader
from edit_train.cluster.mesh import Topology, init_topology, parallelize
from edit_train.cluster.threads import ThreadBudget
from edit_train.config import cluster_specs
from edit_train.model import CausalLM, count_params
from edit_train.sim.build import step_hooks
from edit_train.train.expert_subsets import follow, frozen_rows
from edit_train.timing import TimeAccount, window
from edit_train.local_sgd.aggregator import capabilities_of
from edit_train.local_sgd.errors import SyncAborted
from edit_train.local_sgd.aggregation.rules import make_rule
from edit_train.memplan import OutOfMemory, out_of_memory_line, plan_for_config
from edit_train.train.build import build_algorithm, my_cluster
from edit_train.train.progress import Progress, TrainingState, process_start, record_path, restart_count
from edit_train.train.summary import cluster_record, write_cluster_summary
from edit_train.train.checkpoint import CheckpointManager
from edit_train.train.lr import LrSchedule
from edit_train.train.metrics import JsonlSink, MetricsLogger
from edit_train.train.mfu import device_peak_flops, flops_per_token, mfu
from edit_train.train.optim import build_optimizer, step_unless
from edit_train.train.parallel import apply_layer_options, precision_policy
from edit_train.train.evaluation import batch_loss, evaluate, probe_batch, reshard
from edit_train.train.spike import SpikeGuard
from edit_train.train.run_config import note_start
from edit_train.train.resume import Resumable, find_resume, resume, save_checkpoint
from edit_train.train.signals import Interrupted, StopSignal
from edit_train.train.finished import peer_news
from edit_train.local_sgd.sync import waits
from edit_train.train.routing import RoutedTally, expert_bias_hook
from edit_train.train.site_data import check_tokenizers, open_data, site_data

log = logging.getLogger(__name__)


def says_once(is_leader: bool, index: int) -> bool:
    """Whether this rank says what is said once per run: a cluster's leader, and under the local launcher
    (its clusters share one console) only the first cluster's."""
    return is_leader and (index == 0 or os.environ.get("EDIT_TRAIN_LAUNCHER_BAR") != "1")


def agree_on_config(cfg: Config, topo: Topology) -> Config:
    """Every rank of the cluster adopts its rank 0's resolved config (`${now:}` may differ between ranks)."""
    if not topo.distributed:
        return cfg
    from edit_train.config import from_container

    return from_container(topo.group.broadcast_json(to_container(cfg) if topo.rank == 0 else None))


class Trainer:
    def __init__(self, cfg: Config) -> None:
        validate(cfg)
        self.specs = cluster_specs(cfg)
        self.spec = my_cluster(cfg, self.specs)
        self.topo = init_topology(self.spec.name, self.spec.index, self.spec.ranks,
                                  self.spec.device or cfg.train.device, cfg.cluster.backend, cfg.cluster.timeout_s)
        self.cfg = cfg = agree_on_config(cfg, self.topo)
        topo = self.topo
        self.federated = len(self.specs) > 1 or bool(cfg.federation.lighthouse)
        self.run_dir = Path(cfg.run.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        self.is_leader = topo.is_leader  # this cluster's rank 0
        # intra-op threads: the cores this job may use, shared with the other training processes on the host
        self.threads = ThreadBudget(cfg.train.threads, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                    says=says_once(self.is_leader, self.spec.index))
        self.threads.apply()
        self.timing = TimeAccount()  # where this rank's wall time goes (summary per_cluster.time, train events)
        t = cfg.train
        self.rank_batch = self.spec.batch_size or t.batch_size
        self.cluster_batch = self.rank_batch * topo.ranks
        # this cluster's counters across its incarnations (restarted, resumed or healed: it keeps counting)
        self.record_found = record_path(self.run_dir, topo.name).exists()
        self.state = TrainingState.begin(self.run_dir, topo.name, self.cluster_batch * t.seq_len * t.grad_accum,
                                         started=process_start())
        self.state.schedule = LrSchedule.of(t)  # a resume may continue the checkpoint's instead
        self._compute_since_commit = 0.0
        self._syncs_seen = 0
        # steps whose outcome (loss, agreed loss, applied, spike, batches) is still on the device: read by `_settle`
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, list[Any]]] = []
        self._last_applied = True

        # ---- data: this cluster's own part (site_data.py), prepared once by rank 0, cached for everyone else
        check_tokenizers(cfg, [self.spec])
        self.site = site_data(cfg, self.specs, self.spec)
        self.data_dir, self.val_dirs = open_data(cfg, self.site, self.cluster_batch, self.is_leader, self._barrier)
        self.loader = TokenLoader(self.data_dir, "train", self.cluster_batch, t.seq_len,
                                  part=self.site.part, num_parts=self.site.parts, seed=cfg.seed)

        self._build_model()  # replicated per cluster, sharded inside it; its precision and optimizer
        # injected faults and simulated slowness: the loop's one seam (sim/hooks.py; a no-op when none is configured)
        self.sim = step_hooks(cfg, topo, self.specs, self.run_dir, step=lambda: self.state.step)
        self.spike = SpikeGuard(t.spike_factor, t.spike_patience, t.spike_requeue_after)
        self.stop = StopSignal(f"cluster {topo.name}")
        waits.NEWS[:] = [lambda: peer_news(self.run_dir, topo.name, [s.name for s in self.specs])]  # waits say it

        # ---- output
        ckpt_root = self.run_dir / "checkpoints" / topo.name if self.federated else self.run_dir / "checkpoints"
        self.ckpt = CheckpointManager(ckpt_root, topo.rank, topo.ranks, cfg.checkpoint.keep,
                                      barrier=self._barrier)
        resume_from = self._resume_point()
        self.metrics = MetricsLogger(self._sinks(resume_from))
        probe = self._usefulness_probe()
        self.frozen = frozen_rows(cfg, self.model, topo.index, len(self.specs))  # expert subsets (off: None)
        self.tally = RoutedTally(self.model, topo, self.metrics.log, lambda: self.state.step, cfg.algo.local_sgd,
                                 cfg.algo.warmup_steps, t.log_every,  # routed tokens per expert and interval
                                 owned=lambda: self.frozen.owned if self.frozen else self._routed_map())
        self.algo = build_algorithm(cfg, self.model, topo, self.metrics, self.optimizer, self.federated,
                                    span=self.timing.span, tokens_per_step=self.state.tokens_per_step,
                                    probe_loss=probe, wrap_transport=self.sim.transport,
                                    routed_counts=self.tally.hook(),  # the sync closes the local-SGD intervals
                                    bias_hook=expert_bias_hook(self.model, cfg.model,  # algo.expert_bias
                                                               lambda: self.frozen.owned if self.frozen else
                                                               self._routed_map()))
        if self.is_leader and topo.index == 0:  # config.json once; a resume's changes appended to resumes.jsonl
            note_start(self.run_dir, to_container(cfg))
        self.resumable = Resumable(self.model, self.optimizer, self.algo.state, self.loader, self.spike, self.timing)
        if resume_from is not None:
            resume(resume_from, self.state, self.resumable, self.record_found, self.is_leader)
        self._saved_step = self.state.step if resume_from is not None else -1  # own step of the newest checkpoint
        self.timing.attach_blocked(lambda: self.algo.blocked_s)  # after resume restored the counter

    def _routed_map(self) -> tuple[tuple[bool, ...], ...] | None:
        """Per MoE layer, the experts this cluster owns under a decided `expert_subsets=routed` map (None: every
        one)."""
        return self.algo.owned_experts(self.cfg.model.num_experts)

    def _follow_map(self) -> None:
        """Under `expert_subsets=routed`: freeze the experts this cluster does not own once the map reaches it,
        from the anchor's values (their progress since the last sync is let go), and say so in one event."""
        frozen = follow(self.frozen, self.model, self._routed_map())
        if frozen is self.frozen or frozen is None:
            return
        self.frozen = frozen
        self.algo.to_anchor()
        self.metrics.log("expert_subsets", step=self.state.step, cluster=self.topo.name,
                         experts=[[e for e, o in enumerate(layer) if o] for layer in frozen.owned])  # per layer

    # ------------------------------------------------------------------ build
    def _build_model(self) -> None:
        """The model (replicated per cluster, sharded inside it), its precision, activation checkpointing and
        compile (train/parallel.py), FSDP2 with its mixed-precision policy, the optimizer and the MFU constants."""
        cfg, t, topo = self.cfg, self.cfg.train, self.topo
        counts = count_params(cfg.model)
        self.param_counts = counts
        # once per run: the local launcher's clusters share one console (their own jobs: each says it)
        if says_once(self.is_leader, topo.index):
            log.info("model: %s total params, %s active per token", f"{counts['total_params']:,}",
                     f"{counts['active_params']:,}")
        self.model = CausalLM(cfg.model).to(topo.device)
        if cfg.model.init_from:
            from edit_train.model.hf_io import load_hf_into

            load_hf_into(self.model, cfg.model.init_from)
        self.precision = precision_policy(t.precision, topo.device, sharded=topo.distributed and topo.ranks > 1)
        apply_layer_options(self.model, t.activation_checkpointing, t.compile, topo.device,
                            self.precision.compute_dtype)
        parallelize(self.model, topo, self.precision.fsdp_param_dtype)
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len, counts["active_params"])
        self.peak_flops = device_peak_flops(topo.device, t.peak_flops)  # per device; None: no MFU (CPU)
        self.optimizer = build_optimizer(self.model.named_parameters(), t, topo.device)  # fused on CUDA

    def _resume_point(self) -> Any:
        """The checkpoint to resume from (`find_resume`'s answer), None for a fresh start. A worker restarted by
        torchrun / the local launcher (--max-restarts) always resumes."""
        restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or \
            os.environ.get("EDIT_TRAIN_RESTART", "0") != "0"
        wants = str(self.cfg.resume).lower() in ("true", "auto") or restarted
        return find_resume(self.ckpt, self.cfg, self.is_leader) if wants else None

    def _sinks(self, resume_from: Any) -> list[Any]:
        """metrics.jsonl, and W&B on the cluster's leader when `logger.kind=wandb` (`self.wandb`; a resumed run
        continues its W&B run)."""
        cfg, topo = self.cfg, self.topo
        sinks: list[Any] = [JsonlSink(self.run_dir / "metrics.jsonl")]
        self.wandb = None
        if cfg.logger.kind == "wandb" and topo.is_leader:
            from edit_train.train.wandb_sink import WandbSink

            self.wandb = WandbSink(self.run_dir, cfg.logger.project, cfg.logger.entity, cfg.logger.mode,
                                   experiment=cfg.run.name, job_type=f"{cfg.cluster.name}-{topo.name}",
                                   name=f"{cfg.run.name}-{topo.name}", config=to_container(cfg),
                                   tags=list(cfg.logger.tags),
                                   run_id=resume_from[2].get("wandb_run_id") if resume_from else None)
            sinks.append(self.wandb)
        return sinks

    def _usefulness_probe(self) -> Callable[[], float] | None:
        """The rule's probe of each update's usefulness (`Capabilities.probe_tokens`): the global model's loss on a
        fixed batch of validation tokens (None: no probe)."""
        cfg, topo = self.cfg, self.topo
        tokens = capabilities_of(make_rule(cfg.algo.rule)).probe_tokens if cfg.algo.local_sgd else 0
        if tokens <= 0:
            return None
        batch = probe_batch(self.val_dirs, cfg.train.seq_len, tokens, topo.index)
        return lambda: batch_loss(self.model, batch, topo, self._autocast)

    # ------------------------------------------------------------------ utils
    def _barrier(self) -> None:
        if self.topo.distributed:
            dist.barrier(group=self.topo.shard_pg)

    def _autocast(self) -> contextlib.AbstractContextManager:
        return self.precision.autocast(self.topo.device.type)  # no-op under FSDP2 bf16 params or fp32

    def _cluster_mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over the cluster's ranks, on the device (no host read)."""
        if self.topo.ranks > 1:
            value = value.to(self.topo.device).clone()
            dist.all_reduce(value, group=self.topo.shard_pg)
            value = value / self.topo.ranks
        return value

    def _cluster_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of ``value`` over the cluster's ranks, on the device (no host read)."""
        value = value.to(self.topo.device).clone()
        dist.all_reduce(value, group=self.topo.shard_pg)
        return value

    def _local_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.loader.next_batch()
        b, r = self.rank_batch, self.topo.rank
        return x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]

    # ------------------------------------------------------------------- eval
    def evaluate(self) -> float:
        """Mean val loss of the global model (after a flush); every rank of the cluster takes part."""
        with self.timing.span("sync"):
            self.algo.flush()
        return evaluate(self.model, self.val_dirs, self.cfg.train, self.topo, self._autocast)

    def eval_logged(self) -> float:
        """Evaluate the global model and log it (charged to the `eval` bucket)."""
        with self.timing.span("eval"):
            val_loss = self.evaluate()
            self._log_eval(val_loss)
        return val_loss

    def eval_by_source(self) -> dict[str, float] | None:
        """The final model's val loss on each source of a shared validation of several (each language or family
        alone: its share of the same windows, so their mean is the overall loss when the batches divide); None
        with one source."""
        if len(self.val_dirs) < 2:
            return None
        t = dataclasses.replace(self.cfg.train, eval_batches=max(1, -(-self.cfg.train.eval_batches
                                                                      // len(self.val_dirs))))
        with self.timing.span("eval"):
            return {src: evaluate(self.model, [d], t, self.topo, self._autocast)
                    for src, d in zip(self.site.val_sources, self.val_dirs)}

    def _log_eval(self, val_loss: float) -> None:
        p = self.state
        record = {"step": p.step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50)),
                  "tokens": p.tokens, "wall": p.wall()}
        if self.topo.is_leader:
            self.metrics.log("eval", cluster_index=self.topo.index, cluster=self.topo.name, **record)

    # ------------------------------------------------------------ checkpoint
    def save_checkpoint(self) -> Path:
        self._settle()  # the skipped steps and re-queued batches it saves
        with self.timing.span("checkpoint"):
            # one meaning for a checkpoint's name, step_N: the federation's agreed step (the largest step count
            # any cluster had reached at the last exchange; never lower than this cluster's own, so the newest
            # checkpoint is the one with the largest name). Under lockstep it is every cluster's own step; under
            # a time schedule the clusters' own counts differ, and the agreed one names the checkpoints the
            # clusters took after the same sync (the end-of-run ones: after the final sync) alike, so
            # `edit-train-export` finds one step all clusters have. The cluster's own step, the one it resumes
            # from, is in the checkpoint's state (`step`) and in the log line below.
            step = self.state.step if self.algo.lockstep else max(self.algo.global_step, self.state.step)
            path = save_checkpoint(self.ckpt, step, self.state, self.resumable, self.cfg,
                                   self.wandb.run_id if self.wandb else None)
        self._saved_step = self.state.step
        if self.is_leader:
            own = "" if step == self.state.step else f" (cluster {self.topo.name}'s own step {self.state.step:,})"
            log.info("checkpoint saved: %s%s", path, own)
        return path

    # ------------------------------------------------------------------- loop
    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One inner step (with gradient accumulation). Returns (loss, applied) as 0-d tensors on the device.

        Nothing here reads the device back (no host sync: the CPU queues the next step while the GPU runs this
        one): the loss accumulates on the device, the finite-gradient check and the spike guard decide there and
        the fused optimizer skips on that decision (`step_unless`). `_settle` reads the outcomes at the next log
        step, checkpoint or the end, and logs the `skip` / `spike` events then."""
        t, topo = self.cfg.train, self.topo
        device_type = topo.device.type
        lr = self.sim.lr(step, self.state.schedule.at(step))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.set_step(step)
        loss_sum = torch.zeros((), dtype=torch.float64, device=topo.device)
        with self.timing.span("data"):
            batches = self.spike.pop_due(step) or [self._local_batch() for _ in range(t.grad_accum)]
        # bf16 working copies: one cast per optimizer step (one micro-batch casts once anyway, and frees the copies
        # during its backward: no region, no copies kept to the step's end)
        region = self.precision.optimizer_step(device_type) if len(batches) > 1 else contextlib.nullcontext()
        with region:
            for x, y in batches:
                x, y = self.sim.batch(step, x, y)
                try:
                    with self._autocast():
                        out = self.model(x.to(topo.device, non_blocking=True), y.to(topo.device, non_blocking=True))
                except SyncAborted:  # a participant was lost in the layer-wise sync: rolled back, run the forward again
                    reshard(self.model)
                    torch.clear_autocast_cache()  # copies of the weights before the rollback
                    with self._autocast():
                        out = self.model(x.to(topo.device, non_blocking=True), y.to(topo.device, non_blocking=True))
                with self.precision.backward(device_type):
                    (out.loss / len(batches)).backward()
                loss_sum += out.ce_loss.detach().to(loss_sum.dtype) / len(batches)
        self.sim.grads(step, self.model)
        spike, shared = None, loss_sum
        if self.spike.enabled:  # the spike decision needs the loss every rank sharing the update agrees on
            with self.timing.span("sync"):
                agreed = self.algo.after_backward(step, self._cluster_mean(loss_sum.reshape(1))[0])
            shared = torch.as_tensor(agreed, device=topo.device)
            spike = self.spike.decide(shared)
        else:
            with self.timing.span("sync"):
                self.algo.after_backward(step, None)
        self._follow_map()  # expert_subsets=routed: the map the sync core decided (or healed, or resumed)
        if self.frozen is not None:
            self.frozen.hold()  # the experts this cluster does not own stay at the anchor
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip if t.grad_clip > 0 else math.inf)
        finite = torch.isfinite(torch.as_tensor(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm))
        step_unless(self.optimizer, ~finite if spike is None else ~finite | spike)
        # model.moe_router_enable_expert_bias: once per optimizer step, from the step's load summed over the
        # cluster's ranks (every rank applies the same update); algo.expert_bias=global adds the other clusters' load
        self.model.update_expert_bias(self.algo.bias_load(step, self._cluster_sum if self.topo.ranks > 1 else None))
        if self.frozen is not None:
            self.frozen.restore()
        self.optimizer.zero_grad(set_to_none=True)
        applied = finite if spike is None else finite | spike  # a spike's skip is not a non-finite step
        self._pending.append((step, loss_sum, shared, applied, spike,
                              [(x.clone(), y.clone()) for x, y in batches] if spike is not None else []))
        self._last_out = out
        self._lr = lr
        return loss_sum, applied

    def _settle(self) -> bool:
        """Read the outcomes of the steps since the last read (one host read) and act on them: a non-finite step
        is counted and logged (`skip`), a spike's batches are re-queued and logged (`spike`). Returns whether
        the last step's update was applied."""
        if not self._pending:
            return self._last_applied
        topo, pending, self._pending = self.topo, self._pending, []
        zero = torch.zeros((), dtype=torch.bool, device=topo.device)
        rows = torch.stack([torch.stack([loss.double(), shared.double(), applied.double(),
                                         (zero if spike is None else spike).double()])
                            for _, loss, shared, applied, spike, _ in pending]).tolist()
        if self.spike.enabled:
            self.spike.read()
        for (step, *_, batches), (loss, shared, applied, spiked) in zip(pending, rows):
            if spiked:
                self.spike.requeue(step, batches)
                if topo.is_leader:
                    self.metrics.log("spike", step=step + 1, cluster_index=topo.index, cluster=topo.name, loss=shared,
                                     running_mean=self.spike.mean, requeued_for=step + self.spike.requeue_after)
            elif not applied:
                self.state.skipped_steps += 1
                log.warning("cluster %s step %d: non-finite loss/gradient, inner step skipped", topo.name, step)
                if topo.is_leader:
                    self.metrics.log("skip", step=step + 1, cluster_index=topo.index, cluster=topo.name,
                                     reason="non_finite", loss=loss)
        self._last_applied = bool(rows[-1][2])
        return self._last_applied

    def run(self) -> dict[str, Any]:
        cfg, t, topo, p = self.cfg, self.cfg.train, self.topo, self.state
        p.t0 = time.time()
        tokens_per_step = p.tokens_per_step
        self.timing.claim("startup")  # everything since the process began building this trainer
        with self.timing.span("startup", keeps_blocked=True):  # waiting for the federation to form is start-up
            adopted = self.algo.join()
        if adopted is not None:
            p.step = max(p.step, adopted)  # a healed cluster continues from the federation's step
        p.startup_s = time.time() - p.t_start
        # a bar on a terminal, periodic log lines elsewhere (a Slurm .out file); the local launcher draws its own
        own_bar = self.is_leader and t.progress and os.environ.get("EDIT_TRAIN_LAUNCHER_BAR") != "1"
        bar = Progress([topo.name], t.steps, cfg.algo.name, enabled=own_bar, initial={topo.name: p.step})
        if p.step == 0 and p.initial_val_loss is None:  # the run's start: its first eval, not a restart's (which
            p.set_initial_val_loss(self.eval_logged())   # may come back at step 0 on the weights it healed to)
        window_tokens, window_time = 0, self.timing.snapshot()
        while not self.algo.should_stop(p.step):
            signum = self._stop_asked(p.step)
            if signum is not None:
                bar.close()
                log.warning("rank %d: signal %d received, stopping at step %d", topo.rank, signum, p.step)
                saved = self._save_interrupted()
                if self.is_leader:
                    p.save()  # the counters up to here (tokens, clocks): the next launch counts on from them
                self._settle()
                self.metrics.close(None)
                raise Interrupted(f"stopped by signal {signum} at step {p.step}" +
                                  (f", checkpoint {saved.name} saved" if saved is not None else ""))
            step = p.step
            self.sim.before_step(step, self.algo)  # the simulation may end this process or cut the cluster off here
            step_t0, blocked0, compute0 = time.time(), self.algo.blocked_s, self.timing.totals["compute"]
            with self.timing.span("compute"):
                loss, _ = self.train_step(step)  # on the device: read at log steps only (`_settle`)
            # after the compute, its own bucket: simulated slower hardware stretches compute only
            # (forward/backward/optimizer), not the data, the sync's own work or the waits on other clusters
            with self.timing.span("slowdown"):
                self.sim.after_step(step, self.timing.totals["compute"] - compute0)
            p.trained()
            window_tokens += tokens_per_step
            self.tally.counted()  # before the sync that may close the interval (RoutedTally.hook)
            with self.timing.span("sync"):
                outcome = self.algo.after_step(step, time.time() - step_t0)
            if outcome.adopt_step is not None:  # healed mid-run: continue from the federation's step
                p.step = outcome.adopt_step
            if self.tally.due(p.step, self.algo.local_steps):  # ddp, warm-up: every log_every steps
                self.tally.take()
            self._account_useful(time.time() - step_t0 - (self.algo.blocked_s - blocked0))
            if p.step % t.log_every == 0 or p.step == t.steps:
                applied = self._settle()
                loss_t = self._cluster_mean(loss.reshape(1))
                now, split = time.time(), self.timing.snapshot()
                window_split, window_time = window(split, window_time), split
                tps, window_tokens = window_tokens / max(window_split["wall_s"], 1e-9), 0
                step_mfu = mfu(tps, self.flops_per_token, self.peak_flops, topo.ranks)
                if step_mfu is not None:
                    p.mfu.append(step_mfu)
                if topo.is_leader:
                    self.metrics.log("train", step=p.step, cluster_index=topo.index, cluster=topo.name, loss=float(loss_t),
                                     lr=self._lr, tokens=p.tokens, tokens_per_s=tps, mfu=step_mfu,
                                     wall=p.wall(), skipped=not applied, time_s=window_split)
                    self._log_moe(p.step)
                    p.save(every_s=2.0)  # counters across incarnations (a killed cluster loses at most ~2 s of them)
                self.threads.maybe_replan()
                bar.report(topo.name, p.step, float(loss_t), tps)
            bar.advance(topo.name, p.step)
            if self.algo.lockstep and t.eval_every and p.step % t.eval_every == 0 and not self.algo.should_stop(p.step):
                self.eval_logged()
            elif not self.algo.lockstep and outcome.eval_due:  # every cluster sees the same exchange: all eval
                self.eval_logged()
            # lockstep: every cluster at the same multiple of checkpoint.every (a sync boundary, config.py says;
            # when the syncs follow the lr, the first boundary past each multiple); a time schedule: each cluster
            # at its own pace, right after a sync (Pacer.checkpoint_due)
            every = cfg.checkpoint.every
            due = every > 0 and (self.algo.saves_at(p.step, every) if self.algo.lockstep else outcome.checkpoint_due)
            if due and not self.algo.should_stop(p.step):
                with self.timing.span("sync"):
                    self.algo.flush()
                self.save_checkpoint()
        bar.close()
        with self.timing.span("sync"):
            self.algo.finish()
        self._settle()
        if self.tally.steps:  # the last interval (the final sync's)
            self.tally.take()
        self._account_useful(0.0, final=True)
        val_loss = self.eval_logged()
        by_source = self.eval_by_source()
        if cfg.checkpoint.at_end:
            self.save_checkpoint()
        summary = self._summary(val_loss, by_source)
        self.metrics.close(summary)
        self.algo.close()
        if topo.distributed:
            dist.barrier(group=topo.shard_pg)
        return summary

    def _stop_asked(self, step: int) -> int | None:
        """The signal that stops the loop at this step boundary, or None. A cluster of several ranks stops where
        every rank does: its ranks agree at each log step (`train.log_every`, where they read the device
        anyway), so a checkpoint's collectives and the last steps line up on every rank."""
        if self.topo.ranks == 1:
            return self.stop.signum
        if step % max(self.cfg.train.log_every, 1) != 0:
            return None
        flag = torch.tensor([self.stop.signum or 0], dtype=torch.int64, device=self.topo.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.topo.shard_pg)
        return int(flag.item()) or None

    def _save_interrupted(self) -> Path | None:
        """Under `checkpoint.at_end`, an interrupted run keeps what it trained: a checkpoint at this step
        boundary (after any sync in flight finished or gave up), unless it has one of this step already or
        trained nothing. `resume=auto` continues from it."""
        p = self.state
        if not self.cfg.checkpoint.at_end or p.step == 0 or p.step == self._saved_step:
            return None
        try:
            with self.timing.span("sync"):
                self.algo.flush()  # a sync in flight: finished, or rolled back where the federation gave up
            return self.save_checkpoint()
        except Exception as exc:  # noqa: BLE001 - the interrupt is said either way; the older checkpoints stand
            log.warning("cluster %s: no checkpoint at the interrupt (step %d): %s", self.topo.name, p.step, exc)
            return None

    def _account_useful(self, compute_s: float, final: bool = False) -> None:
        """Compute time counts as useful once a sync committed it (or, without a federation, at once)."""
        self._compute_since_commit += max(compute_s, 0.0)
        committed = self.algo.syncs_done > self._syncs_seen or not self.federated or not self.cfg.algo.local_sgd
        if committed or final:
            self._syncs_seen = self.algo.syncs_done
            self.state.carried.useful_s += self._compute_since_commit if committed else 0.0
            self._compute_since_commit = 0.0
            if self.is_leader and (self.federated and self.cfg.algo.local_sgd or final):
                self.state.save()

    def _summary(self, val_loss: float, by_source: dict[str, float] | None = None) -> dict[str, Any]:
        """This cluster's record merged by its leader with every other cluster's into `summary.json`."""
        record = cluster_record(self.state, self.topo.group, self.algo.stats(), index=self.topo.index,
                                device=str(self.topo.device), algo=self.cfg.algo.name, param_counts=self.param_counts,
                                val_loss=val_loss, restarts=restart_count(), slowdown_slept_s=self.sim.slept_s,
                                time_split=self.timing.snapshot())
        record["train_steps"] = self.cfg.train.steps  # the run it ended (finished.py: a time schedule's end)
        if by_source:
            record["final_val_loss_by_source"] = by_source
        if self.cfg.algo.local_sgd:  # the outer step it ran with, and whether the default by cluster count chose it
            record["outer"] = outer_step(self.cfg).record()
        record["memory_plan_gib"] = plan_for_config(self.cfg)["total_gib"]  # per rank (edit-train-info's plan)
        if self.topo.device.type == "cuda":  # this rank's peak, to hold against the plan
            record["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.topo.device) / 1024 ** 3
        if not self.is_leader:
            return {}
        self.state.save()  # the clocks up to the end: the next incarnation's downtime starts here
        summary = write_cluster_summary(self.run_dir, record, [s.name for s in self.specs])
        self._tell_finished(int(record["steps"]))
        return summary

    def _tell_finished(self, steps: int) -> None:
        """Tell the federation's gate (signed by this cluster's roster identity) that this cluster finished: a
        peer relaunched later on its own run.dir then exits instead of training alone (cli/checks.py)."""
        f = self.cfg.federation
        if not (self.federated and f.lighthouse and f.roster_file):
            return
        from edit_train.federation import auth
        from edit_train.federation.quorum import tell_finished
        from edit_train.train.build import credentials

        try:
            key = auth.resolve(f.key_file, f.insecure, [f.lighthouse])
            creds = credentials(self.cfg, self.topo.name)
        except Exception as exc:  # noqa: BLE001 - the run is done; this is only news for a later relaunch
            log.warning("not telling the gate that cluster %s finished: %s", self.topo.name, exc)
            return
        tell_finished(f.lighthouse, self.topo.name, steps, key, creds)

    def _log_moe(self, step: int) -> None:
        out = self._last_out
        loads = [load.tolist() for load in self.model.expert_load()]
        extra = {} if out.mtp_loss is None else {"mtp_loss": float(out.mtp_loss.detach())}  # model with MTP layers
        self.metrics.log("moe", step=step, cluster_index=self.topo.index, cluster=self.topo.name, expert_load=loads,
                         aux_loss=float(out.aux_loss.detach()), z_loss=float(out.z_loss.detach()), **extra)


def train(cfg: Config) -> dict[str, Any]:
    """Train this rank; out of device memory is one line naming the memory plan's figure (`OutOfMemory`)."""
    try:
        trainer = Trainer(cfg)
    except torch.OutOfMemoryError:
        device = "cuda" if cfg.train.device != "cpu" and torch.cuda.is_available() else "cpu"
        raise OutOfMemory(out_of_memory_line(cfg, None, torch.device(device))) from None
    try:
        return trainer.run()
    except torch.OutOfMemoryError:
        raise OutOfMemory(out_of_memory_line(trainer.cfg, trainer.state.step, trainer.topo.device)) from None
    finally:
        trainer.stop.finished()  # a signal from here on: one line and exit, not a traceback from the shutdown
        trainer.algo.close()
        if trainer.topo.distributed and dist.is_initialized():
            dist.destroy_process_group()
