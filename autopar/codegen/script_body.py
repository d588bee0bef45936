"""The fixed part of generated training scripts (``train_script.py`` puts the plan's literals above it).

It imports autopar's runtime, so the script runs the very code ``autopar verify`` and
``autopar.runtime.apply`` run; everything the plan chose is a literal of the script.
"""

BODY = r'''

# --------------------------------------------------------------------------------------------------
# Everything below only reads the literals above.


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="steps of the whole run (a resumed run goes on to it)")
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate of AdamW")
    ap.add_argument("--warmup-steps", type=int, default=0, help="linear warmup, then cosine decay to 10 %%")
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="bf16: what the plan priced")
    ap.add_argument("--seed", type=int, default=0, help="initial weights (the same for every layout)")
    ap.add_argument("--data", metavar="PATH", help="token shards: a file, a folder or a glob of .bin/.npy token "
                    "files or parquet/Arrow files of token lists (HF datasets)")
    ap.add_argument("--data-dtype", choices=("uint16", "uint32"), default="uint16", help="of .bin shards")
    ap.add_argument("--data-column", default="input_ids", help="the token column of parquet/Arrow shards")
    ap.add_argument("--eos-id", type=int, metavar="ID", help="the token that ends each document of .bin/.npy shards")
    ap.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True,
                    help="read the windows of --data in a seeded random order (a new one each epoch)")
    ap.add_argument("--data-seed", type=int, default=0, help="the order --shuffle reads the data in")
    ap.add_argument("--data-workers", type=int, default=0, metavar="N", help="loader worker processes per rank")
    ap.add_argument("--document-masking", action="store_true", help="attention within each document of a sample "
                    "only (block-causal; --data's boundaries; SDPA with an explicit mask, eager blocks)")
    ap.add_argument("--checkpoint", metavar="DIR", help="save the run's state under DIR/step-N at the end (and every "
                    "--checkpoint-every steps): model, optimizer, step, data position, RNG")
    ap.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="also save every N steps")
    ap.add_argument("--keep", type=int, default=None, metavar="K", help="keep the K newest checkpoints")
    ap.add_argument("--async-checkpoint", action="store_true", help="write checkpoints in the background")
    ap.add_argument("--log-every", type=int, default=10, metavar="N",
                    help="log every N steps (and the first and last); the steps between wait on nothing")
    ap.add_argument("--metrics", default=str(Path(__file__).with_name("metrics.jsonl")), metavar="FILE",
                    help="JSON lines of the logged steps (appended; default: metrics.jsonl beside this script)")
    ap.add_argument("--tensorboard", metavar="DIR", help="also write them to TensorBoard (the tensorboard extra)")
    ap.add_argument("--init-from", metavar="DIR", help="initial weights: a HuggingFace folder of .safetensors files "
                    "(the model's own parameter names) or a DCP checkpoint (its model only); ignored when resuming")
    ap.add_argument("--max-bad-steps", type=int, default=10, metavar="N",
                    help="steps with a non-finite loss or gradient norm are skipped; stop after more than N")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=COMPILE,
                    help="torch.compile each block (default: as the plan priced it)")
    ap.add_argument("--resume", metavar="PATH", help="continue from a checkpoint (or the latest under a folder; "
                    "default: the latest under --checkpoint, if any)")
    args = ap.parse_args()
    device = device_for_rank()
    try:
        check_compiled(SCHEDULE, MESH_SHAPE[2], RECOMPUTE, args.compile)
        if args.document_masking:
            check_document_masking(args.data, MESH_SHAPE[2], args.compile)
        if FP8_LINEARS:
            check_fp8_device(device)
    except AutoparError as exc:  # one line, from the first rank; every rank stops
        if os.environ.get("RANK", "0") == "0":
            print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
        else:
            time.sleep(2)  # torchrun stops every rank when one fails: the first one prints before the others end
        raise SystemExit(2) from None
    if device.type == "cpu":
        return_freed_tensors_to_the_os()  # so that peak RSS measures live tensors
    init_distributed(device)  # a run torchrun restarted meets in a store of its own
    if dist.get_world_size() != math.prod(MESH_SHAPE):
        raise SystemExit(f"this plan needs {math.prod(MESH_SHAPE)} ranks, got {dist.get_world_size()}")
    mesh = init_device_mesh(device.type, MESH_SHAPE, mesh_dim_names=MESH_DIMS)
    context = context_of(mesh, SEQ_LEN)  # context parallelism: this rank's slice of every sequence
    module = load_module(MODEL_FILE, EXAMPLE_INPUTS)
    build = lambda: build_from(module, CONFIG, MODEL_FILE)  # noqa: E731
    chunks = rank_chunks(SCHEDULE, mesh.get_local_rank("pp"), MESH_SHAPE[0], len(STAGE_LAYERS))
    report = StepReport(ESTIMATE, GLOBAL_BATCH * SEQ_LEN, math.prod(MESH_SHAPE), PEAK_FLOPS, device)

    # 1. pipeline split, 2. tensor parallelism, 3. expert parallelism, 4. activation checkpointing, 5. compile,
    # 6. data parallelism at the ZeRO level; all on the meta device, then this rank's shards are allocated and
    # initialized.
    parts = parallelize(build, mesh, device, args.seed, stage_layers=STAGE_LAYERS, chunks=chunks,
                        container=LAYER_CONTAINER, ends=STACK_ENDS,
                        tp_styles=lambda chunk, part: TP_PLAN.get(chunk, {}),
                        tied=TIED, recompute=RECOMPUTE, zero=ZERO, precision=args.precision, context=context,
                        fp8_linears=FP8_LINEARS, fp8_param_gather=FP8_PARAM_GATHER, ep=EP, experts=EXPERTS,
                        compile=args.compile)
    config = TrainingConfig(lr=args.lr, warmup_steps=args.warmup_steps,
                            decay_steps=max(1, args.steps - args.warmup_steps), max_grad_norm=args.max_grad_norm,
                            precision=args.precision)
    trainer = Trainer(parts, mesh, loss_fn_of(module), chunks=chunks,
                      num_chunks=len(STAGE_LAYERS), schedule=SCHEDULE, num_microbatches=NUM_MICROBATCHES,
                      micro_batch=MICRO_BATCH, zero=ZERO, tied=TIED, config=config, device=device,
                      loss_parallel=LOSS_PARALLEL, context=context)
    first = dist.get_rank() == 0
    begin = 0
    resume = args.resume
    if resume is None and args.checkpoint and checkpoint.complete_checkpoints(args.checkpoint):
        resume = args.checkpoint  # a run restarted (torchrun --max-restarts) goes on from its latest checkpoint
    try:
        if resume:  # the whole state: weights, AdamW's moments, the step, the data position, the RNG
            position = checkpoint.load(trainer, resume)
            if position.samples != position.step * GLOBAL_BATCH:
                raise AutoparError(f"the checkpoint consumed {position.samples} samples in {position.step} steps; "
                                   f"this plan's global batch is {GLOBAL_BATCH}")
            begin = position.step
            if first:
                print(f"resumed at step {begin}", flush=True)
        elif args.init_from:  # the weights only
            loaded = checkpoint.init_weights(trainer, args.init_from)
            if first:
                print(f"initial weights: {loaded}", flush=True)
        data = TokenData(args.data, args.data_dtype, args.data_column, args.eos_id, args.shuffle, args.data_seed,
                         documents=args.document_masking, workers=args.data_workers) if args.data else None
        batches, source = run_batches(module, build_on_meta(build).model, CONFIG, GLOBAL_BATCH, SEQ_LEN,
                                      mesh.get_local_rank("dp"), MESH_SHAPE[1], args.seed, data, start_step=begin)
    except AutoparError as exc:  # every rank raised it (the ranks agree before reading; every rank opens the
        # same data): one line, every rank stops
        if first:
            print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        raise SystemExit(2) from None
    saver = checkpoint.Checkpointer(trainer, args.checkpoint, keep=args.keep, asynchronous=args.async_checkpoint) \
        if args.checkpoint else None
    if first:
        print(f"data: {source}", flush=True)
        if args.compile:
            print(f"compile: {compiled_blocks(parts, LAYER_CONTAINER)} blocks torch.compile'd", flush=True)
    if begin >= args.steps:  # a run restarted after its last save
        if first:
            print(f"the checkpoint is at step {begin}: nothing left of --steps {args.steps}", flush=True)
        dist.destroy_process_group()
        return
    metrics = MetricsLog(args.metrics, args.tensorboard) if first else None
    since, start = 0, time.perf_counter()
    for step in range(begin, args.steps):
        try:
            inputs, documents = next(batches)  # documents: with --document-masking, each token's document
        except AutoparError as exc:  # this rank's data (ids beyond the vocabulary): torchrun stops the others
            print(f"train.py: error: rank {dist.get_rank()}: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        loss = trainer.step(inputs, sync=False, documents=documents)
        since, done = since + 1, step + 1
        logs = step == begin or done == args.steps or done % max(1, args.log_every) == 0
        saves = saver and (done == args.steps or (args.checkpoint_every and done % args.checkpoint_every == 0))
        if (logs or saves) and int(trainer.bad_steps) > args.max_bad_steps:
            stop_for_bad_steps(int(trainer.bad_steps), args.max_bad_steps, step, saver, args.checkpoint, first)
        if logs:
            loss = float(loss)  # the one wait on the device of the interval
            norm = None if trainer.last_grad_norm is None else float(trainer.last_grad_norm)
            if device.type == "cuda":
                torch.cuda.synchronize()
            line = report.step(step, loss, (time.perf_counter() - start) / since, since, norm,
                               int(trainer.bad_steps))
            if first:
                print(line, flush=True)
                metrics.write(report.last_record)
            since, start = 0, time.perf_counter()
        if saves:
            saving = time.perf_counter()
            saver.save(checkpoint.Position(done, done * GLOBAL_BATCH))
            start += time.perf_counter() - saving  # the steps' time, not the save's
    if saver:
        saver.wait()
    if metrics:
        metrics.close()
    summary = report.summary_line()
    if first:
        print(summary, flush=True)
    end_distributed()  # the ranks meet, then exit without the interpreter's teardown (see its docstring)


def stop_for_bad_steps(bad: int, limit: int, step: int, saver, root: str | None, first: bool) -> None:
    """End the run, every rank, with no further checkpoint: the last one stays the latest."""
    if saver:
        saver.wait()  # the save in flight holds good weights: a skipped step changes none
    if first:
        latest = checkpoint.complete_checkpoints(root)[-1:] if root else []
        where = f"the latest checkpoint is {latest[0]}" if latest else "no checkpoint was saved"
        print(f"train.py: error: {bad} steps had a non-finite loss or gradient norm, more than --max-bad-steps "
              f"{limit}; stopped at step {step} ({where})", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    raise SystemExit(3)


if __name__ == "__main__":
    main()
'''
