"""The S3 word problem: a small state-tracking task where n_h > 1 visibly matters.

Tokens are the 6 elements of the symmetric group S3; the target at position t is the
prefix product x_0 x_1 ... x_t. A one-layer Gated DeltaProduct with n_h = 1 (Gated DeltaNet)
cannot represent the 3-cycles (rotations) with one Householder reflection per token, so it
fails to extrapolate; n_h = 2 writes each element as a product of two reflections and
tracks the group exactly (Grazzi et al., "Unlocking state-tracking in linear RNNs
through negative eigenvalues"; Siems et al., "DeltaProduct"). The model: embedding -> one
GatedDeltaProduct layer (no gate, beta = 2 sigmoid) with a residual -> small MLP ->
linear readout.

Training runs context-parallel over a ``cp`` mesh axis when ``devices > 1``: every sequence
is split contiguously along T over the devices and the layer runs with ``cp_axis="cp"``.
:func:`cp_agreement` checks a trained model the cheap way: its loss, logits and parameter
gradients with context parallelism equal those on one device.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Optional

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
from flax import nnx

from gdp_jax.nn import GatedDeltaProduct

# --- the group -------------------------------------------------------------------------

PERMS = list(itertools.permutations(range(3)))          # 6 elements; PERMS[0] = identity
_INDEX = {p: i for i, p in enumerate(PERMS)}
# (a * b)(i) = a(b(i)): apply b first, then a.
MUL = np.array([[_INDEX[tuple(a[b[i]] for i in range(3))] for b in PERMS] for a in PERMS],
               np.int32)


def sample_batch(rng: np.random.Generator, batch: int, seq_len: int):
    """Random words and their prefix products: (tokens, targets), both [batch, seq_len] int32.

    targets[:, t] = tokens[:, 0] * tokens[:, 1] * ... * tokens[:, t] (each new element
    multiplied on the right).
    """
    x = rng.integers(0, 6, size=(batch, seq_len), dtype=np.int32)
    y = np.empty_like(x)
    acc = np.zeros(batch, np.int32)
    for t in range(seq_len):
        acc = MUL[acc, x[:, t]]
        y[:, t] = acc
    return x, y


# --- the model -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class S3Config:
    """The S3 model. Defaults: what learns S3 in a few hundred CPU steps.

    Many small heads (16 x K = V = 4) give many independent chances to find the group
    representation; no short convolution (it lets the model shortcut short prefixes),
    no SiLU on q/k/v, and a learned start state (the running product needs a non-zero
    state to act on).
    """
    num_householder: int = 2
    d_model: int = 64
    num_heads: int = 16
    head_dim: int = 4
    mlp_ratio: int = 2
    conv_size: int = 0
    qkv_activation: bool = False
    learn_initial_state: bool = True


def _rms(x, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class S3Model(nnx.Module):
    """Embedding -> GatedDeltaProduct (residual) -> MLP (residual) -> readout [.., 6]."""

    def __init__(self, cfg: S3Config, *, cp_axis: Optional[str] = None, rngs: nnx.Rngs):
        self.embed = nnx.Embed(6, cfg.d_model, rngs=rngs)
        self.mixer = GatedDeltaProduct(
            cfg.d_model, cfg.num_heads, head_k_dim=cfg.head_dim, head_v_dim=cfg.head_dim,
            num_householder=cfg.num_householder, conv_size=cfg.conv_size, use_forget_gate=False,
            allow_neg_eigval=True, qkv_activation=cfg.qkv_activation,
            learn_initial_state=cfg.learn_initial_state, cp_axis=cp_axis, backend="xla",
            rngs=rngs)
        hidden = cfg.mlp_ratio * cfg.d_model
        self.fc1 = nnx.Linear(cfg.d_model, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, 6, rngs=rngs)

    def __call__(self, tokens, cache=None):
        """tokens [B, T] int32 -> logits [B, T, 6] float32; with ``cache`` (the mixer's
        :meth:`~gdp_jax.nn.GatedDeltaProduct.init_cache`) -> (logits, next cache)."""
        # the table's own dtype (nnx.Embed returns float32 even for a float64 table, which
        # would run a float64 check of the model in float32)
        h = jnp.take(self.embed.embedding[...], tokens, axis=0)
        mixed = self.mixer(_rms(h), cache=cache) if cache is not None else self.mixer(_rms(h))
        if cache is not None:
            mixed, cache = mixed
        h = h + mixed
        h = h + self.fc2(jax.nn.gelu(self.fc1(_rms(h))))
        logits = self.head(_rms(h))
        return logits if cache is None else (logits, cache)


def _graphdef(cfg: S3Config):
    graphdef, _ = nnx.split(S3Model(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    return graphdef


def model_logits(cfg: S3Config, params, tokens):
    """The parallel forward of trained ``params`` (an nnx.State of Params): [B, T, 6]."""
    graphdef = _graphdef(cfg)
    return jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, tokens)


def streaming_logits(cfg: S3Config, params, tokens):
    """The same logits computed as generation does: token by token through the layer's
    decoding cache (a ``lax.scan`` of T = 1 calls, each one decoding step). [B, T, 6]."""
    graphdef = _graphdef(cfg)

    def run(p, x):
        model = nnx.merge(graphdef, p)

        def one_token(cache, tok):
            logits, cache = model(tok[:, None], cache=cache)
            return cache, logits[:, 0]

        _, logits = jax.lax.scan(one_token, model.mixer.init_cache(x.shape[0]), x.T)
        return jnp.swapaxes(logits, 0, 1)

    return jax.jit(run)(params, jnp.asarray(tokens))


# --- training --------------------------------------------------------------------------

@dataclasses.dataclass
class TrainResult:
    num_householder: int
    losses: list
    train_len: int
    eval_len: int
    acc_per_position: np.ndarray          # [eval_len] accuracy at each position
    acc_train_len: float                  # mean accuracy over positions < train_len
    acc_eval_len: float                   # mean accuracy over all eval_len positions
    seconds: float
    params: object = None                 # trained nnx.State (nnx.Param leaves)


def make_mesh(devices: int) -> Optional[Mesh]:
    """A 1-D ``cp`` mesh over the first ``devices`` devices, or None for one device.

    Where the default platform has fewer (one GPU), the mesh uses simulated CPU devices.
    """
    if devices <= 1:
        return None
    devs = jax.devices()
    if len(devs) < devices:
        devs = jax.devices("cpu")
    if len(devs) < devices:
        raise ValueError(f"{devices} devices requested, but JAX sees {len(devs)} "
                         f"({devs[0].platform}); for simulated CPU devices run "
                         f'jax.config.update("jax_num_cpu_devices", {devices}) right after '
                         "importing jax")
    return Mesh(np.array(devs[:devices]), ("cp",))


def _loss_fn(model, tokens, targets, cp_axis):
    logits = model(tokens).astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    total, hits, count = nll.sum(), correct.sum(), jnp.float32(nll.size)
    if cp_axis is not None:                                   # local shard -> global mean
        total, hits, count = (jax.lax.psum(a, cp_axis) for a in (total, hits, count))
    return total / count, hits / count


def build_steps(cfg: S3Config, mesh: Optional[Mesh], lr: float, steps: int, seed: int):
    """Create the model + optimizer and jitted (train_step, eval_fn) closures.

    train_step(state, tokens, targets) -> (state, loss, acc)
    eval_fn(state, tokens, targets) -> correct [B, T] float32
    Under a mesh, tokens/targets [B, T] are split along T over ``cp`` and the
    parameters are replicated.
    """
    import optax

    cp_axis = "cp" if mesh is not None else None
    model = S3Model(cfg, cp_axis=cp_axis, rngs=nnx.Rngs(seed))
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), max(2, steps),
                                               lr * 0.05)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    graphdef, params = nnx.split(model, nnx.Param)
    opt_state = tx.init(params)
    if mesh is not None:      # replicated from the start: the first step's output matches
        rep = jax.sharding.NamedSharding(mesh, P())
        params, opt_state = jax.device_put((params, opt_state), rep)

    def grad_fn(params, tokens, targets):
        def f(p):
            return _loss_fn(nnx.merge(graphdef, p), tokens, targets, cp_axis)
        (loss, acc), grads = jax.value_and_grad(f, has_aux=True)(params)
        return loss, acc, grads

    def correct_fn(params, tokens, targets):
        logits = nnx.merge(graphdef, params)(tokens)
        return (jnp.argmax(logits, -1) == targets).astype(jnp.float32)

    if mesh is not None:
        grad_fn = jax.shard_map(grad_fn, mesh=mesh, in_specs=(P(), P(None, "cp"), P(None, "cp")),
                                out_specs=(P(), P(), P()))
        correct_fn = jax.shard_map(correct_fn, mesh=mesh,
                                   in_specs=(P(), P(None, "cp"), P(None, "cp")),
                                   out_specs=P(None, "cp"))

    @jax.jit
    def train_step(state, tokens, targets):
        params, opt_state = state
        loss, acc, grads = grad_fn(params, tokens, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), loss, acc

    eval_fn = jax.jit(correct_fn)
    return (params, opt_state), train_step, eval_fn


def train_s3(num_householder: int, *, steps: int = 400, seq_len: int = 16, batch: int = 16,
             eval_factor: int = 4, eval_batch: int = 256, devices: int = 1, lr: float = 1e-2,
             seed: int = 0, cfg: Optional[S3Config] = None,
             progress: Optional[Callable[[int, float, float], None]] = None) -> TrainResult:
    """Train one model on S3 words of length ``seq_len`` and evaluate at ``eval_factor`` x.

    ``progress(step, loss, acc)`` is called after every step.
    """
    cfg = dataclasses.replace(cfg or S3Config(), num_householder=num_householder)
    mesh = make_mesh(devices)
    for L in (seq_len, eval_factor * seq_len):
        if mesh is not None and L % devices:
            raise ValueError(f"sequence length {L} must be divisible by devices={devices}")
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    state, train_step, eval_fn = build_steps(cfg, mesh, lr, steps, seed)
    losses = []
    for step in range(steps):
        x, y = sample_batch(rng, batch, seq_len)
        state, loss, acc = train_step(state, x, y)
        loss, acc = float(loss), float(acc)
        losses.append(loss)
        if progress is not None:
            progress(step, loss, acc)
    eval_len = eval_factor * seq_len
    x, y = sample_batch(np.random.default_rng(seed + 12345), eval_batch, eval_len)
    correct = np.asarray(eval_fn(state[0], x, y))
    per_pos = correct.mean(0)
    return TrainResult(num_householder, losses, seq_len, eval_len, per_pos,
                       float(per_pos[:seq_len].mean()), float(per_pos.mean()),
                       time.perf_counter() - t0, params=state[0])


def cp_agreement(cfg: S3Config, params, devices: int, tokens, targets,
                 dtype=jnp.float32) -> dict:
    """Relative RMS differences, CP over ``devices`` vs one device, of one batch's logits,
    loss and parameter gradients (all leaves together), computed in ``dtype`` (float64
    needs ``jax_enable_x64``: then the differences are rounding of float64, ~1e-15).
    tokens/targets [B, T] int32, T a multiple of devices."""
    mesh = make_mesh(devices)
    if tokens.shape[1] % devices:
        raise ValueError(f"tokens has shape {tokens.shape}; expected T divisible by "
                         f"devices={devices}")
    params = jax.tree_util.tree_map(lambda p: jnp.asarray(p, dtype), params)
    # Both runs on the mesh's devices (CPU ones where the default platform has too few).
    params = jax.device_put(params, jax.sharding.NamedSharding(mesh, P()))

    def model_fn(cp_axis):
        graphdef = nnx.split(S3Model(cfg, cp_axis=cp_axis, rngs=nnx.Rngs(0)), nnx.Param)[0]

        def loss_of(p, x, y):
            logits = nnx.merge(graphdef, p)(x)
            nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1)
            total, count = nll.sum(), jnp.asarray(nll.size, logits.dtype)
            if cp_axis is not None:
                total, count = jax.lax.psum(total, cp_axis), jax.lax.psum(count, cp_axis)
            return total / count, logits

        def f(p, x, y):
            (loss, logits), grads = jax.value_and_grad(loss_of, has_aux=True)(p, x, y)
            return logits, loss, grads
        return f

    one = jax.jit(model_fn(None))(*jax.device_put((params, tokens, targets),
                                                  mesh.devices.flat[0]))
    sp = P(None, "cp")
    cp = jax.jit(jax.shard_map(model_fn("cp"), mesh=mesh, in_specs=(P(), sp, sp),
                               out_specs=(sp, P(), P())))(params, tokens, targets)

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b * b)), 1e-30))
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(t)])
    return dict(logits=rel(cp[0], one[0]), loss=rel(cp[1], one[1]),
                grads=rel(flat(cp[2]), flat(one[2])))
