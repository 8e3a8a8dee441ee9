"""The trunk as a pipeline of stages: the same model, its layers placed on N stages.

    model = load_model(dir, backend="cuda", stages=2)             # balanced by weight bytes
    model = load_model(dir, backend="cuda", stage_layers="0-2,3-5", devices=[0, 0])
    model.placement.ranges                                        # ((0, 3), (3, 6))

StagedGlm5Model is a Glm5Model: prime, decode_step, verify_rows, rollback and rewind keep their
signatures and contracts, so the speculative core and every draft source run on it unchanged.
What differs is where things live and how a walk runs:
* stage s owns placement.layers(s): their weights, KDA states and rings, latent planes and pool
  keys are made on its device; the embedding is on the first stage; the final norm, the lm head,
  the MTP block (and the embedding copy it and the draft sources read) on the last, whose device
  is made current at load (draft sources, sampling and host copies run there).
* a walk runs stage by stage, each stage inside its lane (device + stream) through its own walk
  runner (on CUDA: its own captured graphs); the t rows' mHC streams, the taps so far and the
  shared indexer selections later stages need cross each cut through the transport.
* rollback, rewind and cache creation touch each stage's planes inside that stage's lane.
Every stage runs the very ops of the unsplit walk on the very inputs, in the same order, so the
logits, collapsed rows and taps equal the unsplit model's bit for bit (tests/pipeline/).
"""

from __future__ import annotations

from memra.config import DSA
from memra.errors import InputError
from memra.model import hyper
from memra.model.mtp import MtpBlock
from memra.model.stages import StagePlan, stage_devices
from memra.model.transport import Boundary, InProcessTransport, lanes_for
from memra.model.trunk import Glm5Model, TrunkLayer


class StageWalks:
    """A cache's walk runners, one per stage (each captures its own graphs on CUDA)."""

    def __init__(self, runners):
        self.stages = tuple(runners)

    @property
    def enabled(self) -> bool:
        return all(r.enabled for r in self.stages)

    @enabled.setter
    def enabled(self, on: bool) -> None:
        for r in self.stages:
            r.enabled = on


class StagedGlm5Model(Glm5Model):
    def __init__(self, cfg, weights: dict, backend, plan: StagePlan, devices=None, transport=None):
        if plan.num_layers != cfg.num_hidden_layers:
            raise InputError(f"the stage plan covers {plan.num_layers} layers but the model has "
                             f"{cfg.num_hidden_layers}; plan the stages for this config")
        devices = stage_devices(devices, plan.count)
        self.cfg, self.be, self.placement = cfg, backend, plan
        self.lanes = lanes_for(backend, devices)
        self.transport = InProcessTransport(self.lanes) if transport is None else transport
        be, last = backend, plan.count - 1
        with self.lanes.scope(0):
            self.first_embed = be.weight(weights["embed_tokens.weight"])
        self.stage_layers = []
        for s in range(plan.count):
            with self.lanes.scope(s):
                self.stage_layers.append([TrunkLayer(be, weights, cfg, i) for i in plan.layers(s)])
        self.layers = [layer for stage in self.stage_layers for layer in stage]
        with self.lanes.scope(last):
            same = self.lanes.devices[0] == self.lanes.devices[last]
            self.chains_device_ids = same  # the last stage's argmax feeds the first stage's embedding
            self._hold_the_head(weights, self.first_embed if same else None)
        self.lanes.make_current(last)
        self.selections_in, self.selections_out = selection_routes(cfg, plan)

    def _hold_the_head(self, weights: dict, embed) -> None:
        """The last stage's parts, made in its lane: the embedding (`embed`, the first stage's
        table when both share a device, else None: a copy), the final norm, the lm head, the MTP block."""
        be, cfg = self.be, self.cfg
        self.embed_table = be.weight(weights["embed_tokens.weight"]) if embed is None else embed
        self.lm_head = be.matrix(weights["embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"])
        self.final_norm = be.weight(weights["norm.weight"])
        self.mtp = MtpBlock(be, weights, cfg, self.embed_table, self.lm_head) if cfg.has_mtp else None

    def on_stage(self, stage: int):
        """A context in which work on stage `stage`'s planes runs where that stage runs (its
        device and stream), ordered with the walks: for callers that touch planes directly."""
        return self.lanes.scope(stage)

    # ---- seams of Glm5Model: every stage's planes, runners and rollback in its own lane ------
    def _new_walks(self):
        return StageWalks(self.be.walks() for _ in range(self.placement.count))

    def _walks_of(self, cache, index: int):
        return cache.walks.stages[self.placement.stage_of(index)]

    def _new_planes(self, cache, layers) -> None:
        self._by_stage(layers, lambda part: super(StagedGlm5Model, self)._new_planes(cache, part))

    def _new_snapshots(self, layers, cache) -> None:
        self._by_stage(layers, lambda part: super(StagedGlm5Model, self)._new_snapshots(part, cache))

    def _rollback_layers(self, layers, cache, ckpt, keep: int) -> None:
        self._by_stage(layers, lambda part: super(StagedGlm5Model, self)._rollback_layers(part, cache, ckpt, keep))

    def _by_stage(self, layers, fn) -> None:
        for s in range(self.placement.count):
            part = [layer for layer in layers if self.placement.stage_of(layer.index) == s]
            if part:
                with self.lanes.scope(s):
                    fn(part)

    # ---- the staged walk ---------------------------------------------------------------------
    def _run_walk(self, tokens, cache, snapshots: bool, tap_layers: tuple, replay: bool):
        """Stage by stage (each replays its own walk shape, keyed as the unsplit walk's) ->
        what the unsplit walk returns."""
        for s in range(self.placement.count):
            out, taps = self._stage_turn(s, tokens, cache, snapshots, tap_layers, replay)
        logits, collapsed = out
        return logits, collapsed, taps

    def _stage_turn(self, s: int, tokens, cache, snapshots: bool, tap_layers: tuple, replay: bool):
        """Stage s's turn of a walk, in its lane: receive the boundary (s > 0), walk its layers,
        send its own boundary on (s < last) -> (its output, the taps so far)."""
        last, pos0 = self.placement.count - 1, cache.pos
        key = self._walk_key(tokens, snapshots, tap_layers, replay)
        with self.lanes.scope(s):
            received = self.transport.recv(s) if s else Boundary(None)
            arrays = () if s == 0 else (received.streams, *(received.selections[i] for i in self.selections_in[s]))
            walk = lambda tok, at, *inputs: self._stage_walk(s, tok, at, inputs, cache, snapshots, tap_layers)
            out, tapped, selected = cache.walks.stages[s].run(key, walk, tokens, pos0, *arrays)
            taps = {**received.taps, **tapped}
            if s < last:
                ahead = {**received.selections, **selected}
                self.transport.send(s, Boundary(out, taps, {i: ahead[i] for i in self.selections_out[s]}))
        return out, taps

    def _stage_walk(self, s: int, tokens, at, inputs: tuple, cache, snapshots: bool, tap_layers: tuple):
        """Stage s's device work -> (streams, or (logits, collapsed) on the last stage; its
        taps; the selections of its indexer layers that later stages read)."""
        layers = self.stage_layers[s]
        if s == 0:
            streams = hyper.expand(self.be.embed(self.first_embed, tokens), self.cfg.hc_mult)
        else:
            streams = inputs[0]
        selections = dict(zip(self.selections_in[s], inputs[1:]))
        tapped: dict = {}
        streams = self._walk_layers(layers, streams, at, cache, selections, snapshots, tap_layers, tapped)
        out = self._head(streams) if s == self.placement.count - 1 else streams
        start = self.placement.ranges[s][0]
        selected = {i: selections[i] for i in self.selections_out[s] if i >= start}
        return out, tapped, selected


def selection_routes(cfg, plan: StagePlan) -> tuple[list[tuple], list[tuple]]:
    """(per stage: the indexer layers of earlier stages whose selections it reads, in order;
    per cut s: the selections that cross it, i.e. made on stages <= s, read on stages > s).
    A `shared` indexer layer reads the selection of the last full one before it, which a cut
    may put on an earlier stage."""
    reads_in = [set() for _ in range(plan.count)]
    crosses = [set() for _ in range(plan.count)]
    for layer in range(cfg.num_hidden_layers):
        if cfg.layer_types[layer] != DSA:
            continue
        source = cfg.indexer_source(layer)
        made, read = plan.stage_of(source), plan.stage_of(layer)
        if made < read:
            reads_in[read].add(source)
            for cut in range(made, read):
                crosses[cut].add(source)
    return [tuple(sorted(r)) for r in reads_in], [tuple(sorted(c)) for c in crosses]
