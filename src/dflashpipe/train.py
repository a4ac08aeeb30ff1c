"""Stage 4, train: the DFlash drafter from feature shards, one process per device (torchrun).

    manifest check ─► drafter sized like the target (its embedding + LM head, frozen)
      ─► per epoch: packed micro-batches (data.py) ─► forward (flex / SDPA masks) ─► the loss of
          train.loss (loss.py: decay CE by default; forward KL, D-PACE, -E[tau], greedy labels),
          the target's distribution where it needs one: its whole one from the stored final
          hidden states through the frozen head, else its top-k soft targets
      ─► backward (DDP, accumulation) ─► clip ─► AdamW ─► warmup+cosine
      ─► every log_every: reduce metrics, JSONL (+ TensorBoard) ─► every checkpoint_every: save
      ─► export results/drafter/ (rank 0)

Launched by `python -m dflashpipe train` (launcher.py: picks the devices and runs torchrun;
gloo and CPU processes when there is no GPU); metrics.py holds the FLOP count and the log. Nothing in the step reads a value back to the host: loss
and metrics are accumulated on the device and read only at log intervals.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dflashpipe import checkpoint, faults
from dflashpipe.compile_cache import carried
from dflashpipe.config import Config, load_config
from dflashpipe.data import (
    PackedBatches,
    Sample,
    epoch_plan,
    first_answers,
    index_samples,
    make_loader,
    split_validation,
    subset,
    to_device,
)
from dflashpipe.errors import DataError
from dflashpipe.export import save_drafter
from dflashpipe.features import (
    choose_mask_token,
    extra_features,
    features_digest,
    read_manifest,
    target_source,
)
from dflashpipe.launcher import TrainPaths, die_with_parent
from dflashpipe.metrics import (
    MetricsLog,
    RunFacts,
    selector_row,
    selector_sums,
    selector_width,
    slot_row,
    slot_sums,
    slot_width,
    step_flops,
)
from dflashpipe.model import FROZEN_PREFIXES, Drafter, DrafterConfig, init_from_target_layers
from dflashpipe.objective import compute_head, forward_loss, selector_settings, train_objective
from dflashpipe.shards import check_manifest, verify_shard
from dflashpipe.stages import ABSENT, digest_keys, fingerprint_keys
from dflashpipe.stages import value as config_value
from dflashpipe.storage import atomic_path, write_json

log = logging.getLogger("dflashpipe.train")


def _FULL(cpu_offload: bool = True, strict: bool = True):
    """Options for whole (unsharded) model / optimizer state dicts under FSDP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload, strict=strict)


def shard_fsdp(drafter: Drafter, device: torch.device) -> Drafter:
    """FSDP2: each decoder layer its own unit, the rest (fc, norms) the root's. The target's
    frozen embedding and LM head stay whole on every rank (ignored): the loss reads the head
    outside the drafter's forward, and all-gathering a 150k-row table each step would cost
    more than it saves."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    frozen = {p for p in drafter.parameters() if not p.requires_grad}
    for layer in drafter.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(drafter, mesh=mesh, ignored_params=frozen)
    return drafter


def decay_groups(drafter: Drafter) -> list[dict]:
    """AdamW's parameter groups: weight decay on matrices only, never on the norms' gains (decay
    would pull them to 0) nor on DFlash2's base kernels (3-D, but a gain: tap 0 is 1, the
    identity convolution, which decay would erode)."""
    params = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    gain = [p for n, p in params if p.ndim < 2 or n.endswith(".base_kernel")]
    return [{"params": [p for _, p in params if not any(p is g for g in gain)]},
            {"params": gain, "weight_decay": 0.0}]  # fmt: skip


def check_resumed_keys(result, path: Path) -> None:
    """A checkpoint resumed into the drafter fills every weight but the target's frozen
    embedding and LM head, and holds nothing else; anything more or less (another architecture,
    another shape of drafter) is refused naming the keys, never silently re-initialised."""
    missing = [k for k in result.missing_keys if not k.startswith(FROZEN_PREFIXES)]
    unexpected = list(result.unexpected_keys)
    if missing or unexpected:
        raise DataError(
            f"checkpoint {path} does not fit this drafter: weights it lacks {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, weights it has that the drafter does not "
            f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} (made for another "
            "drafter.architecture or shape?); move the run directory aside to train afresh"
        )


class FirstStep:
    """Where the time before training's first optimizer step goes (a large share of a short
    run on a GPU, spent compiling): logged once, on rank 0, as the wait for the loader's first
    micro-batch, the step itself, and the Dynamo and Inductor compile time in it."""

    def __init__(self, step: int, device: torch.device) -> None:
        self.start, self.step, self.device = time.perf_counter(), step, device
        self.compiled = compile_seconds()  # cumulative per process: count from here
        self.waited: float | None = None

    def batch(self) -> None:
        if self.waited is None:
            self.waited = time.perf_counter() - self.start

    def done(self, step: int) -> None:
        if step != self.step + 1 or self.waited is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        took = time.perf_counter() - self.start - self.waited
        log.info("first optimizer step after %.1f s: %.1f s waiting for the first micro-batch, "
                 "%.1f s in the step, of which %.1f s compiling", self.waited + took, self.waited,
                 took, compile_seconds() - self.compiled)  # fmt: skip


def compile_seconds() -> float:
    """Seconds Dynamo and Inductor have spent compiling in this process, forward and backward
    graphs (torch._dynamo.utils.compile_times)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv")
    timed = dict(zip(names, values, strict=True))
    keys = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")
    return sum(float(v) for k in keys for v in str(timed.get(k, "0")).split(","))


class Trainer:
    """Built in the order torchtitan's is, each part by its own builder: the features (manifest,
    vouched shards), the model (checked against the target, sized like it) and its wrap (DDP or
    FSDP2), the data plan (samples, held-out, steps), the optimizer, the checkpoint state
    (settings, fingerprint) and the resume from it. `train` is the loop."""

    def __init__(self, cfg: Config, manifest_path: Path, run_dir: Path, device: torch.device):
        self.cfg, self.tc, self.device, self.run_dir = cfg, cfg.train, device, run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.tokens = self.tc.micro_batch_tokens or self.tc.max_length
        # on a GPU, fp8 packs cross as e4m3 bytes and are dequantized there (data.to_device)
        self.quantized = device.type == "cuda"
        self._find_features(Path(manifest_path))
        self._build_model()
        self._wrap_model()
        self._select_samples(Path(manifest_path))
        self._plan_steps()
        self._build_optimizer()
        self._checkpoint_state()
        self.step, self.epoch, self.micro = 0, 0, 0
        self._resume()

    def _find_features(self, manifest_path: Path) -> None:
        """The manifest, where the target's distribution comes from (features.TargetSource: the
        top-k's k read, the final hidden states read), and every shard trained on beside the
        manifest that vouches for it (the stage's own first, then train.extra_features')."""
        self.manifest = read_manifest(manifest_path)
        needs = self.tc.loss.needs_target(self.tc.distill_weight)
        self.source = target_source(manifest_path, self.manifest, needs,
                                    greedy=self.tc.loss.labels == "greedy")  # fmt: skip
        self.topk = self.source.topk
        # rows that end with the final hidden state have it split off before the drafter's fc
        self.final_width = self.manifest["hidden_size"] if self.manifest.get("final_hidden") else 0
        if needs and self.rank == 0:
            log.info("%s: the target's distribution is %s", ", ".join(needs),
                     self.source.describe())  # fmt: skip
        self.own = [Path(s["path"]) for s in self.manifest["shards"]]
        extra = [extra_features(Path(p), self.manifest, self.topk) for p in self.tc.extra_features]
        self.vouched = [(path, self.manifest) for path in self.own]
        self.vouched += [(path, manifest) for manifest, paths in extra for path in paths]
        self.shards = [path for path, _ in self.vouched]

    def _select_samples(self, manifest_path: Path) -> None:
        """The samples trained on and held out: the own shards' split, the extra features'
        added (trained on, never held out: the held-out figures stay the own), then
        train.answers_per_prompt and train.sample_fraction."""
        own, tc = self.own, self.tc
        self.stats: dict = {}
        own_samples = index_samples(own, self.tokens, self.stats, self.topk, self.source.final)
        self.samples, self.val_samples = split_validation(own_samples, tc.val_samples, tc.seed)
        added: list[Sample] = []
        if len(self.shards) > len(own):
            added = index_samples(self.shards[len(own) :], self.tokens, self.stats, self.topk,
                                  self.source.final)  # fmt: skip
            self.samples += [
                Sample(s.shard + len(own), s.row, s.length, answer=s.answer) for s in added
            ]
        if tc.answers_per_prompt is not None:
            held = 1 + max(s.answer for s in own_samples + added)
            if tc.answers_per_prompt > held:
                extra = " and train.extra_features" if added else ""
                raise DataError(
                    f"train.answers_per_prompt is {tc.answers_per_prompt}, but the features "
                    f"of {manifest_path}{extra} hold at most {held} answers per prompt "
                    f"(regenerate.samples_per_prompt): the run would train on the same data as "
                    f"answers_per_prompt {held}"
                )
            self.samples = first_answers(self.samples, tc.answers_per_prompt)
        available = len(self.samples)
        self.samples = subset(self.samples, tc.sample_fraction, tc.seed)
        self.train_tokens = sum(s.length for s in self.samples)  # per epoch (metrics rows)
        if self.rank == 0:
            from_extra = sum(s.shard >= len(own) for s in self.samples)
            share = (f"; train.sample_fraction {tc.sample_fraction:g} of {available}"
                     if tc.sample_fraction < 1 else "")  # fmt: skip
            if tc.answers_per_prompt is not None:
                share += f"; train.answers_per_prompt {tc.answers_per_prompt}"
            log.info("training on %d samples (%d of them from train.extra_features), %d tokens "
                     "an epoch, %d held out%s", len(self.samples), from_extra, self.train_tokens,
                     len(self.val_samples), share)  # fmt: skip

    def _plan_steps(self) -> None:
        """The held-out plan, micro-batches an epoch, accumulation and the optimizer steps."""
        tc = self.tc
        if self.val_samples:
            try:
                self._val_plan = epoch_plan(
                    self.val_samples, self.tokens, tc.seed, 0, self.rank, self.world
                )
            except DataError as e:
                raise DataError(f"train.val_samples {len(self.val_samples)}: {e}") from None
        self.per_epoch = len(
            epoch_plan(self.samples, self.tokens, tc.seed, 0, self.rank, self.world)
        )
        self.accum = max(1, (tc.tokens_per_step or 0) // (self.tokens * self.world))
        self.total_micro = math.ceil(tc.epochs * self.per_epoch)
        self.total_steps = max(1, self.total_micro // self.accum)
        if tc.max_steps:
            self.total_steps = min(self.total_steps, tc.max_steps)

    def _build_model(self) -> None:
        """The drafter sized like the target (its frozen embedding and head), once the target
        and the features are checked against each other; on a GPU its layers compiled."""
        from dflashpipe.preflight import check_config
        from dflashpipe.target import load_target, target_identity

        check_config(self.cfg)  # drafter.sliding_window against train.max_length and num_layers
        target, tok = load_target(self.cfg.target, torch.device("cpu"))
        identity = json.loads(target_identity(self.cfg.target, tok).to_json())
        tc = target.config.get_text_config()
        check_manifest(self.manifest, {"target.tokenizer_sha256": identity["tokenizer_sha256"],
                                       "target.weights_sha256": identity["weights_sha256"],
                                       "hidden_size": tc.hidden_size})  # fmt: skip
        d = self.cfg.drafter
        if d.target_layer_ids is not None:
            check_manifest(self.manifest, {"layer_ids": d.target_layer_ids})
        for path, manifest in self.vouched[self.rank :: self.world]:  # each shard hashed once
            verify_shard(path, manifest)
        mask_id = (
            d.mask_token_id if d.mask_token_id is not None else choose_mask_token(tok, self.shards)
        )
        self.dcfg = DrafterConfig.from_target(
            target.config, mask_token_id=mask_id, num_layers=d.num_layers, block_size=d.block_size,
            target_layer_ids=self.manifest["layer_ids"], sliding_window=d.sliding_window,
            **d.model_fields(),
        )  # fmt: skip
        torch.manual_seed(self.tc.seed)
        drafter = Drafter.from_target_model(self.dcfg, target)
        if d.init == "target-layers":
            used = init_from_target_layers(drafter, target)
            log.info("drafter layers start from the target's decoder layers %s", used)
        drafter = drafter.to(self.device)
        del target
        for layer in drafter.layers:  # training only: exported and evaluated drafters have none
            layer.dropout = self.tc.dropout
        if self.device.type == "cuda" and self.tc.compile:
            for layer in drafter.layers:  # per layer: every layer kind compiles once
                layer.compile()
        self.drafter = drafter
        self.objective = train_objective(self.tc, self.dcfg.block_size)  # forward_loss's keys
        # dflash2: the selector's term (train.selector, its defaults where unset)
        self.selector = selector_settings(self.tc, self.dcfg.dflash2)
        # the target's logits as its distribution is computed from its final hidden states
        self.softcap = getattr(tc, "final_logit_softcapping", None)

    def _wrap_model(self) -> None:
        """The frozen head as the loss multiplies it, and the drafter as the step runs it: FSDP2
        (train.parallel fsdp), DDP, or itself in a world of one."""
        drafter = self.drafter
        self.head = compute_head(drafter, self.device)
        self.fsdp = self.world > 1 and self.tc.parallel == "fsdp"
        if self.fsdp:
            self.model = shard_fsdp(drafter, self.device)
        elif self.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DDP(drafter, device_ids=ids)
        else:
            self.model = drafter

    def _checkpoint_state(self) -> None:
        """What a checkpoint is made under (the fingerprint) and a finished run records."""
        # Everything train's digest covers (stages.py), the world size (each rank's data
        # position) and the features' content: a finished run records all of it
        # (checkpoint.mark_finished); a checkpoint resumes only when all of it but the
        # resume-safe keys is unchanged (the fingerprint), so a rerun never mixes two
        # configurations.
        self.settings = {k: v for k in digest_keys("train")
                         if (v := config_value(self.cfg.raw, k)) is not ABSENT}  # fmt: skip
        self.settings.update(world=self.world, features=features_digest(self.vouched))
        kept = {*fingerprint_keys("train"), "world", "features"}
        self.fingerprint = {k: v for k, v in self.settings.items() if k in kept}

    def _build_optimizer(self) -> None:
        params = decay_groups(self.drafter) if self.tc.weight_decay else [
            p for p in self.drafter.parameters() if p.requires_grad]  # fmt: skip
        self.optimizer = torch.optim.AdamW(params, lr=self.tc.lr, weight_decay=self.tc.weight_decay,
                                           betas=tuple(self.tc.betas), fused=self.device.type == "cuda")  # fmt: skip
        warmup = max(1, round(self.tc.warmup_ratio * self.total_steps))

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, self.total_steps - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    def state_dict(self) -> dict:
        """Everything a checkpoint holds. Under FSDP a collective (every rank calls it): the
        sharded model and optimizer state are gathered into full tensors on the CPU."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            optimizer = get_optimizer_state_dict(self.drafter, self.optimizer, options=_FULL())
        else:
            optimizer = self.optimizer.state_dict()
        return {"model": self.export_state(), "optimizer": optimizer,
                "scheduler": self.scheduler.state_dict(), "data": {"epoch": self.epoch, "micro": self.micro}}  # fmt: skip

    def export_state(self) -> dict[str, torch.Tensor]:
        """The trainable weights as full tensors (a collective under FSDP)."""
        if not self.fsdp:
            return self.drafter.trainable_state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        full = get_model_state_dict(self.drafter, options=_FULL())
        return {k: v for k, v in full.items() if not k.startswith(FROZEN_PREFIXES)}

    def _set_aside_unless_resumable(self) -> None:
        """Rank 0, before resuming: a run that finished with these very settings, or whose
        checkpoints were made under others, is moved aside for a fresh one. Snakemake reruns a
        finished train job by itself only when a key it reads changed; with none changed, the
        rerun was asked for (--forcerun train, its outputs deleted) and means to train again,
        not to re-export the old drafter. A run cut off before its end resumes; so does a
        finished one after resume-safe edits alone (a longer run)."""
        finished = checkpoint.finished_settings(self.run_dir)
        if finished == json.loads(json.dumps(self.settings)):  # as the record reads back
            moved = checkpoint.set_aside(self.run_dir)
            log.warning("a fresh run: the run in %s finished with this same configuration, so "
                        "this job was asked to train again (--forcerun train, or its outputs "
                        "deleted); the old run is moved to %s", self.run_dir, moved)  # fmt: skip
        elif changed := checkpoint.changed_keys(self.run_dir, self.fingerprint):
            moved = checkpoint.set_aside(self.run_dir)
            log.warning("a fresh run: %s changed since the checkpoints in %s, which are moved "
                        "to %s", ", ".join(changed), self.run_dir, moved)  # fmt: skip
        elif finished is not None:  # resume-safe edits: the run goes on, unfinished until its end
            (self.run_dir / checkpoint.FINISHED).unlink()

    def _resume(self) -> None:
        if self.rank == 0:
            self._set_aside_unless_resumable()
        if self.world > 1:
            dist.barrier()  # every rank sees the run directory as rank 0 left it
        found = checkpoint.load_latest(self.run_dir, self.fingerprint)
        if found is None:
            return
        path, state = found
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import (
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            opts = _FULL(cpu_offload=False, strict=False)
            check_resumed_keys(set_model_state_dict(self.drafter, state["model"], options=opts),
                               path)  # fmt: skip
            set_optimizer_state_dict(self.drafter, self.optimizer, state["optimizer"], options=opts)
        else:
            check_resumed_keys(self.drafter.load_state_dict(state["model"], strict=False), path)
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(state["rng"])
        self.step, self.epoch, self.micro = (
            state["step"],
            state["data"]["epoch"],
            state["data"]["micro"],
        )
        if self.rank == 0:
            log.info(
                "resumed from %s (step %d, epoch %d, micro-batch %d)",
                path,
                self.step,
                self.epoch,
                self.micro,
            )

    def micro_step(self, batch: dict, sync: bool) -> tuple[torch.Tensor, dict]:
        b = to_device(batch, self.device, self.final_width)
        if self.fsdp:
            self.model.set_requires_gradient_sync(sync)  # accumulate locally until the last
            ctx = nullcontext()
        else:
            ctx = self.model.no_sync() if (self.world > 1 and not sync) else nullcontext()
        with ctx:
            loss, metrics = forward_loss(self.model, self.head, b, self.dcfg.block_size,
                                         **self.objective, softcap=self.softcap,
                                         selector=self.selector_term(self.step))  # fmt: skip
            (loss / self.accum).backward()
        anchors_pos = torch.where(b["keep"], b["position_ids"][b["anchors"]], -1)
        metrics["flops"] = step_flops(
            self.dcfg, self.tokens, len(self.dcfg.target_layer_ids), anchors_pos
        )
        metrics["sample_index"] = b["sample_index"]
        return loss.detach(), metrics

    @property
    def gamma(self) -> float:
        """The decay cross-entropy's gamma the objective uses (train_objective's)."""
        return self.objective["gamma"]

    def selector_term(self, step: int) -> tuple | None:
        """forward_loss's selector argument at optimizer step `step` (0-based); None on dflash."""
        if self.selector is None:
            return None
        return self.drafter.candidate_selector, self.selector, self.selector.alpha_at(step)

    def run_facts(self) -> RunFacts:
        """What the metrics log is told of this run."""
        return RunFacts(
            run_dir=self.run_dir, rank=self.rank, world=self.world, device=self.device,
            block_size=self.dcfg.block_size, start_step=self.step, total_steps=self.total_steps,
            micro_batch_tokens=self.tokens, samples=self.samples, train_tokens=self.train_tokens,
            shard_names=[path.name for path in self.shards],
        )  # fmt: skip

    def train(self) -> None:
        logger = MetricsLog(self.run_facts(), self.tc.log_every)
        done = self.step >= self.total_steps
        first = FirstStep(self.step, self.device)
        while not done:
            plan = epoch_plan(
                self.samples, self.tokens, self.tc.seed, self.epoch, self.rank, self.world
            )
            dataset = PackedBatches(self.shards, self.samples, plan, self.tokens, self.tc.num_anchors,
                                    self.tc.seed, self.epoch, self.topk, self.quantized)  # fmt: skip
            loader = make_loader(
                dataset, self.micro, self.tc.num_workers, self.device.type == "cuda"
            )
            for batch in loader:
                first.batch()
                sync = (self.micro + 1) % self.accum == 0
                loss, metrics = self.micro_step(batch, sync)
                logger.add(loss, metrics)
                self.micro += 1
                if not sync:
                    continue
                torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.tc.grad_clip)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.scheduler.step()
                self.step += 1
                if self.rank == 0:
                    first.done(self.step)
                faults.point("train.step")
                validation = None
                if self._validate_now():  # its time is not training time (tokens/s, MFU)
                    with logger.paused():
                        validation = self.validate()
                logger.maybe_write(
                    self.step, self.epoch, self.scheduler.get_last_lr()[0], validation
                )
                if self.step % self.tc.checkpoint_every == 0 or self.step >= self.total_steps:
                    logger.check_finite(self.step)
                    self.save()
                if self.step >= self.total_steps:
                    done = True
                    break
            if not done:
                self.epoch, self.micro = self.epoch + 1, 0
        logger.close()

    def _validate_now(self) -> bool:
        last = self.step >= self.total_steps
        return bool(self.val_samples) and (self.step % self.tc.val_every == 0 or last)

    @torch.no_grad()
    def validate(self) -> dict:
        """Loss, slot accuracy and expected acceptance length on the held-out samples (the same
        micro-batches and anchors every time), reduced over ranks."""
        B = self.dcfg.block_size
        data = PackedBatches(self.shards, self.val_samples, self._val_plan, self.tokens,
                             self.tc.num_anchors, self.tc.seed, epoch=0, topk=self.topk,
                             quantized=self.quantized)  # fmt: skip
        vec = torch.zeros(1 + slot_width(B), device=self.device)  # loss sum, slot_sums
        selector = self.selector_term(self.step - 1)  # the alpha of the step just taken
        sel = torch.zeros(selector_width(B) if selector else 0, device=self.device)
        self.model.train(not self.tc.dropout)  # measured as evaluated: without dropout
        for batch in make_loader(data, 0, workers=0, pin=False):
            b = to_device(batch, self.device, self.final_width)
            loss, m = forward_loss(self.model, self.head, b, B, **self.objective,
                                   softcap=self.softcap, selector=selector)  # fmt: skip
            vec += torch.cat([loss.detach()[None], slot_sums(m)])
            if selector:
                sel += selector_sums(m)
        self.model.train()
        if self.world > 1:
            dist.all_reduce(vec)
            if selector:
                dist.all_reduce(sel)
        batches = len(self._val_plan) * self.world
        row = {"val_loss": vec[0].item() / batches} | slot_row(vec[1:], prefix="val_")
        if selector:
            row |= selector_row(sel, vec[1:], batches, prefix="val_")
        return row

    def save(self) -> None:
        state = self.state_dict()  # every rank: a collective under FSDP
        if self.rank == 0:
            checkpoint.save(
                self.run_dir, self.step, state, self.fingerprint, self.tc.keep_checkpoints
            )
        if self.world > 1:
            dist.barrier()


def run(cfg: Config, paths: TrainPaths, device: torch.device) -> Trainer:
    """One process's share of the stage: train (resuming where the run directory allows), then
    export the drafter and the metrics and record the run finished (rank 0)."""
    run_dir = Path(paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, paths.manifest, run_dir, device)
    trainer.train()
    weights = trainer.export_state()  # every rank: a collective under FSDP
    if trainer.rank == 0:
        save_drafter(trainer.drafter, paths.drafter, dtype=torch.bfloat16, tensors=weights)
        with atomic_path(paths.metrics) as tmp:
            shutil.copyfile(run_dir / "metrics.jsonl", tmp)
        write_json(run_dir / "summary.json", {"steps": trainer.step, "skipped": trainer.stats})
        checkpoint.mark_finished(run_dir, trainer.step, trainer.settings)  # the very last write
    return trainer


def main(argv: list[str] | None = None) -> None:
    """Entry point of one training process, a torchrun worker or the only one: its one argument
    is the launcher's TrainPaths as JSON; the config is the planned one it names."""
    (job,) = sys.argv[1:] if argv is None else argv
    paths = TrainPaths.from_json(job)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = load_config(paths.config)
    use_cuda = torch.cuda.is_available() and os.environ.get("DFLASHPIPE_DEVICE", "") != "cpu"
    if "WORLD_SIZE" in os.environ:
        if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: no life after its agent
            die_with_parent()
        dist.init_process_group("nccl" if use_cuda else "gloo")
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # The launcher sets OMP_NUM_THREADS (cores / processes unless the caller set it): a CPU
    # thread more than the process's share of the cores makes OpenMP spin against its
    # neighbours, which slowed 2-core runs several-fold.
    threads = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(
        int(threads)
        if threads
        else max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    )
    with carried("train"):
        run(cfg, paths, device)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
