"""Defaults shared by every config: each ``configs/<name>.py`` starts from
:func:`get_base_config` (or :func:`bert_config`) and overrides what differs.

Here, in the package, rather than beside the configs: the config loader (``config.loader``) loads
config files by path, so ``configs/`` is not importable, while ``lmscale_jax`` always is.
"""

import ml_collections


def get_base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()

  c.data = ml_collections.ConfigDict()
  c.data.path = ""              # dataset directory; give it on the command line
  c.data.workers = 0            # Grain worker processes (0 = in-process)
  c.data.seed = 0               # shuffle / masking seed
  c.data.mask_prob = 0.15
  c.data.max_predictions = 0    # P; 0 = ceil(mask_prob * seq_len)
  c.data.prefetch_buffer = 4    # Grain ReadOptions, in batches (per worker process)
  c.data.read_threads = 2       # batch builders per process (see input/grain_pipeline.py)
  c.data.on_corrupt = "error"   # unreadable/malformed record: error | skip (all-[PAD] row, counted)
  c.data.shard_by_process = False  # process i reads only shards i::P (stage 1/P per node)
  c.data.stage_from = ""        # shared dataset to stage into data.path first (once per node)
  c.data.stage_workers = 8      # parallel file copies when staging
  c.data.stage_timeout = 7200   # seconds the job waits for every node's staging
  c.data.autotune = False       # measure and pick data.workers (recorded in the workdir)
  c.data.autotune_max_workers = 0  # 0 = the machine's CPU count
  c.data.autotune_target = 0.02    # input wait / step time to reach

  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 0        # 0 = from the dataset's metadata.json
  c.model.seq_len = 0           # 0 = from the dataset's metadata.json (also max positions)
  c.model.layers = 12
  c.model.hidden = 768
  c.model.heads = 12
  c.model.ffn = 3072
  c.model.dropout = 0.1
  c.model.attention_dropout = 0.0  # > 0 leaves the fused attention kernel for an explicit one
  c.model.type_vocab_size = 2
  c.model.layer_norm_eps = 1e-12
  c.model.initializer_range = 0.02
  c.model.norm = "post"         # post (BERT) | pre (pre-LN, undertale)
  c.model.dtype = "bfloat16"    # compute dtype; params are always float32
  c.model.attention_impl = "auto"  # auto | xla | cudnn (auto = cuDNN on GPU in bfloat16)
  # segment: each packed function attends within itself, positions from 0 (as alone) | cross
  # (one window per sequence). Default by benchmarks/bench_packed_attention.py: lower MLM
  # loss on packed and on one-function inputs, same CPU step time (docs/performance.md).
  c.model.packed_attention = "segment"
  # absolute (0..S-1 per sequence) | segment (from 0 at each [CLS]: a packed function gets what
  # it gets alone) | instruction (undertale: instruction + argument index from [NEXT], binary
  # datasets only) | auto: the start model's (a resumed run, init_from), else instruction on
  # binary code and segment on text. Default by benchmarks/longer_functions.sh (same CPU
  # budget, seq 256): instruction took the pretrained + fine-tuned similarity model from
  # 0.404 / 0.473 to 0.458 / 0.536 R@1 at pool 1,000 (docs/similarity.md). docs/training.md
  # "Model variants" has what each costs and gives.
  c.model.positions = "auto"

  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 256      # global sequences per step
  c.train.steps = 1_000_000
  c.train.learning_rate = 1e-4
  c.train.warmup_steps = 10_000
  # > 0: the warm-up is int(fraction × train.steps) instead of warmup_steps, so a
  # --config.train.steps override keeps it (undertale: 2.5%, configs/undertale_medium.py)
  c.train.warmup_fraction = 0.0
  c.train.schedule = "linear"   # linear | cosine
  c.train.end_lr_frac = 0.0
  c.train.weight_decay = 0.01
  c.train.b1 = 0.9
  c.train.b2 = 0.999
  c.train.eps = 1e-6
  c.train.clip_norm = 1.0
  c.train.seed = 0
  c.train.log_every = 100
  c.train.eval_every = 10_000
  c.train.eval_batches = 50
  c.train.remat = "none"        # none | dots | full
  c.train.grad_accum_steps = 1  # microbatches per step (lax.scan in the jitted step)
  c.train.fsdp = False          # shard params + optimizer state over the data axis (ZeRO-3)
  c.train.memory_check = True   # refuse a step whose memory estimate exceeds a device's memory
  c.train.grad_allreduce_dtype = "float32"  # float32 | bfloat16: dtype of the gradient reduction
  # auto | per_tensor | flat: one collective per gradient, or one for them all (auto: flat for
  # CPU processes over gloo, where each collective pays its latency; steps.resolve_grad_allreduce)
  c.train.grad_allreduce = "auto"
  c.train.dropout_rng = "threefry"  # threefry | rbg (RngBitGenerator: cheaper masks on GPU)
  c.train.nonfinite = "error"   # error | skip: on a non-finite loss/gradient (never applied)
  c.train.max_consecutive_nonfinite = 20  # skip mode: stop after this many skips in a row
  c.train.inject_nonfinite_steps = ""     # fault injection (tests): "5,9" poisons those steps

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 10_000
  c.checkpoint.keep = 3         # >= 2: a checkpoint failing verification has one to fall back to
  c.checkpoint.async_save = True  # Orbax saves in the background (was checkpoint.async)
  c.checkpoint.on_full = "error"  # too little free space for a save: error (clean stop) | skip

  # A Hugging Face BertForMaskedLM directory to start pretraining from (its weights at step
  # 0; config.model must have its shape: lmscale import-hf writes such a config). "" = none.
  c.init_from = ""

  c.metrics = ml_collections.ConfigDict()
  c.metrics.peak_tflops = 0.0   # 0 = from the device table (lmscale_jax/model/flops.py)

  # Multi-process start-up (lmscale_jax/cluster/topology.py): unset fields come from LMSCALE_* env,
  # then Slurm; nothing set = one process.
  c.distributed = ml_collections.ConfigDict()
  c.distributed.mode = "auto"          # auto | single (ignore env and Slurm)
  c.distributed.coordinator = ""       # host:port of process 0
  c.distributed.num_processes = 0      # 0 = from env / Slurm
  c.distributed.process_id = -1        # -1 = from env / Slurm
  c.distributed.local_device_ids = ""  # "0,1": devices of this process ("" = env / Slurm / all)
  c.distributed.initialization_timeout = 300  # s for every process to join
  c.distributed.heartbeat_timeout = 60        # s of silence before a process counts as dead
  c.distributed.shutdown_timeout = 300        # s a finished process waits for the others
  return c


def bert_config(*, layers: int, hidden: int, heads: int, ffn: int) -> ml_collections.ConfigDict:
  """A BERT encoder of the given shape at sequence length 512 in bfloat16 with BERT's original
  optimizer settings (global batch 256, peak LR 1e-4, 10k warmup steps, linear decay, 1M
  steps): configs/bert120m.py and configs/bert350m.py."""
  c = get_base_config()
  c.data.workers = 4  # ~20k+ samples/s each on a CPU core: far above the step rate

  c.model.seq_len = 512
  c.model.layers = layers
  c.model.hidden = hidden
  c.model.heads = heads
  c.model.ffn = ffn
  c.model.dtype = "bfloat16"

  c.train.batch_size = 256
  c.train.steps = 1_000_000
  c.train.learning_rate = 1e-4
  c.train.warmup_steps = 10_000
  return c
