"""The bare side of `loop_overhead.py`: one process = one cluster of one rank, a hand-written training loop
around torchft 0.2's `Manager` + `torchft.local_sgd.DiLoCo`, on edit-train's own model class, data, LR
schedule, inner AdamW, gradient clipping, seed and outer optimizer (all from the config `edit-train` composes
for the same overrides). `loop_overhead.py` starts the Lighthouse and two of these; not meant to be run by hand:

    python benchmarks/_bare_diloco.py --cluster c0 --lighthouse http://127.0.0.1:PORT --out c0.json -- OVERRIDES

What it times (`loop_s`): from just before step 0 (after process start, data preparation, model build, the
rendezvous with the other cluster and the initial eval) to the end of the final sync (the trailing
`steps % interval` local steps are synced once more, as `edit-train` does at the end). Inside that window it
also times the data loader (`data_s`) and each sync (`sync_s`: DiLoCo's work inside `optimizer.step()`, waiting
for the other cluster included). Everything else in the window is `compute_s`. It writes JSON only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed import TCPStore
from torchft.checkpointing.transport import CheckpointTransport
from torchft.local_sgd import DiLoCo
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from edit_train.cli.checks import adopt_tokenizer_vocab, explicit_override
from edit_train.cli.common import compose
from edit_train.cluster.mesh import Topology, pick_device
from edit_train.config import cluster_specs
from edit_train.data.loader import TokenLoader
from edit_train.data.prepare import ensure_dataset
from edit_train.model import CausalLM
from edit_train.train.evaluation import evaluate
from edit_train.train.lr import lr_at
from edit_train.train.parallel import precision_policy


class NoHealing(CheckpointTransport[dict[str, Any]]):
    """torchft's checkpoint transport, disabled. Healing is the only user of it, and with `init_sync=False`
    and both clusters starting at step 0 from the same seed nothing ever heals; this makes sure of it (and that
    torchft's default HTTP transport, which unpickles what it receives, is never created)."""

    def metadata(self) -> str:
        return "no-healing"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any],
                        timeout: timedelta) -> None:
        raise RuntimeError(f"bare DiLoCo: cluster(s) {dst_ranks} asked to heal at step {step}; healing is off")

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict[str, Any]:
        raise RuntimeError(f"bare DiLoCo: this cluster would heal from {src_rank} at step {step}; healing is off")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", required=True, help="this cluster's name in cluster_specs (c0, c1, ...)")
    ap.add_argument("--lighthouse", required=True, help="http://HOST:PORT of the torchft Lighthouse")
    ap.add_argument("--out", type=Path, required=True, help="JSON written at the end")
    ap.add_argument("overrides", nargs="*", help="the edit-train overrides (Hydra key=value)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # as edit-train's worker does
    cfg = compose(list(a.overrides))
    adopt_tokenizer_vocab(cfg, explicit_override(a.overrides, "model.vocab_size"))  # as `edit-train` does
    specs = cluster_specs(cfg)
    spec = next(s for s in specs if s.name == a.cluster)
    t, device = cfg.train, pick_device(spec.device or cfg.train.device)

    # ---- the trainer's order: seed, data, model, optimizers (edit_train/train/trainer.py, Trainer.__init__)
    torch.manual_seed(cfg.seed)
    batch, parts = spec.batch_size or t.batch_size, len(specs)  # one rank: the cluster's batch is the rank's
    data_dir = ensure_dataset(cfg.data.source, cfg.data.tokenizer, cfg.data.cache_dir,
                              val_fraction=cfg.data.val_fraction, seed=cfg.data.seed,
                              min_tokens=parts * batch * (t.seq_len + 1))
    loader = TokenLoader(data_dir, "train", batch, t.seq_len, part=spec.index % parts, num_parts=parts,
                         seed=cfg.seed)
    model = CausalLM(cfg.model).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                            weight_decay=t.weight_decay)
    outer = cfg.algo.outer.optimizer_class()(model.parameters(), **cfg.algo.outer.optimizer_kwargs())
    interval = cfg.algo.interval

    # ---- torchft: this cluster's store and Manager (a replica group of one rank), gloo across clusters
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=cfg.federation.collective_timeout_s)),
                      load_state_dict=None, state_dict=None, min_replica_size=parts, use_async_quorum=False,
                      timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=300),
                      rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                      lighthouse_addr=a.lighthouse, replica_id=f"bare_{spec.name}", hostname="127.0.0.1",
                      # init_sync=False: same seed, nothing to sync at step 0, so torchft never heals through its
                      # checkpoint transport (which unpickles); NoHealing makes that a hard error
                      checkpoint_transport=NoHealing(), init_sync=False)
    topo = Topology(1, 0, spec.name, spec.index, device, None)
    policy = precision_policy(t.precision, device, sharded=False)  # fp32: a no-op context, as in edit-train
    autocast = lambda: policy.autocast(device.type)  # noqa: E731

    # the sync runs in DiLoCo's optimizer post-hook; this hook, registered first, marks where it starts
    marks: list[float] = []
    opt.register_step_post_hook(lambda *_: marks.append(time.perf_counter()))
    # anchors next to the model, as edit-train keeps them (algo.outer.offload=false)
    diloco = DiLoCo(manager, [model], opt, outer, sync_every=interval, backup_device=device)
    manager.start_quorum(allow_heal=False)  # rendezvous (and gloo set-up) before the clock starts, like join()
    init_val = evaluate(model, data_dir, t, topo, autocast)

    losses: list[float] = []
    data_s, since_sync = 0.0, 0
    sync_each: list[float] = []  # seconds of every sync
    with diloco:
        t0, ru0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        for step in range(t.steps):
            lr = lr_at(step, t.lr, t.steps, t.lr_warmup_steps, t.min_lr_ratio)
            for group in opt.param_groups:
                group["lr"] = lr
            model.set_step(step)
            td = time.perf_counter()
            batches = [loader.next_batch() for _ in range(t.grad_accum)]
            data_s += time.perf_counter() - td
            loss = 0.0
            for x, y in batches:
                with autocast():
                    out = model(x.to(device), y.to(device))
                (out.loss / len(batches)).backward()
                loss += float(out.ce_loss.detach()) / len(batches)
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else math.inf)
            if bool(torch.isfinite(gnorm)):
                marks.clear()
                opt.step()  # every `interval` applied steps DiLoCo's post-hook syncs inside this call
                since_sync += 1
                if since_sync == interval:
                    sync_each.append(time.perf_counter() - marks[0])
                    since_sync = 0
            opt.zero_grad(set_to_none=True)
            losses.append(loss)
        if since_sync:  # the trailing local steps: one more sync, exactly what DiLoCo's post-hook does
            ts = time.perf_counter()
            manager.start_quorum()
            fragment = diloco._fragments[0]  # noqa: SLF001 (torchft has no public "sync now")
            fragment.prepare_sync()
            fragment.perform_sync()
            sync_each.append(time.perf_counter() - ts)
        loop_s, ru1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    final_val = evaluate(model, data_dir, t, topo, autocast)
    tokens = len(losses) * batch * t.seq_len * t.grad_accum
    record = {"cluster": spec.name, "steps": len(losses), "tokens": tokens, "loop_s": loop_s, "data_s": data_s,
              "sync_s": sum(sync_each), "syncs": len(sync_each), "sync_each_s": sync_each,
              "compute_s": loop_s - data_s - sum(sync_each), "train_tokens_per_s": tokens / loop_s,
              "losses": losses, "initial_val_loss": init_val, "final_val_loss": final_val,
              "threads": torch.get_num_threads(), "manager_step": manager.current_step(),
              # the loop's CPU seconds (all threads), minor page faults and involuntary context switches (contention)
              "loop_cpu_s": ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime,
              "loop_minflt": ru1.ru_minflt - ru0.ru_minflt, "loop_nivcsw": ru1.ru_nivcsw - ru0.ru_nivcsw}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(a.out)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    sys.exit(main())
