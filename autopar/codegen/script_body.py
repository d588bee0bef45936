"""The fixed part of generated training scripts: plain PyTorch, no autopar imports.

``train_script.py`` puts the plan's literals (``MODEL_FILE``, ``MESH_SHAPE``, ``TP_PLAN``, ...) above it.
"""

BODY = r'''

# --------------------------------------------------------------------------------------------------
# Everything below only reads the literals above.


def load_model_file(path):
    spec = importlib.util.spec_from_file_location("user_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["user_model"] = module
    spec.loader.exec_module(module)
    return module


def default_loss(output, ids, *rest):
    """Next-token cross-entropy on the logits (``output.logits`` for HuggingFace models)."""
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def global_batch(module, model, step, seed):
    """The synthetic global batch of ``step``: the same on every rank."""
    torch.manual_seed(seed + 1000 + step)
    gen = torch.Generator().manual_seed(seed + 1000 + step)
    if hasattr(module, "example_inputs"):
        inputs = module.example_inputs(GLOBAL_BATCH, SEQ_LEN, **CONFIG)
        return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    vocab = CONFIG.get("vocab") or next(m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding))
    return (torch.randint(0, vocab, (GLOBAL_BATCH, SEQ_LEN), generator=gen),)


def build_stage(model, chunk):
    """This chunk's copy of the model: its layers, the embeddings on the first, the head on the last."""
    lo, hi = STAGE_LAYERS[chunk]
    first, last = chunk == 0, chunk == len(STAGE_LAYERS) - 1
    stage = copy.deepcopy(model)
    owner, _, attr = LAYER_CONTAINER.rpartition(".")
    blocks = stage.get_submodule(LAYER_CONTAINER)
    if isinstance(blocks, nn.ModuleList):  # keyed by the original index, so parameter names stay the same
        blocks = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
        setattr(stage.get_submodule(owner) if owner else stage, attr, blocks)
    for key in list(blocks.keys()):
        if not lo <= int(key) < hi:
            del blocks[key]
    _drop_ends(stage, LAYER_CONTAINER, first, last)
    if HUGGINGFACE_DECODER:
        stage.forward = hf_stage_forward(stage, HUGGINGFACE_DECODER, first, last)
    return stage


def apply_tp(module, mesh):
    present = {name for name, _ in module.named_modules()}
    plan = {name: style for name, style in TP_PLAN.items() if name in present}
    if plan:
        parallelize_module(module, mesh["tp"], plan)
        for src, alias in TIED:  # parallelize_module unties shared weights: tie them again
            owner, _, attr = alias.rpartition(".")
            src_owner, _, src_attr = src.rpartition(".")
            if owner in present and src_owner in present:
                setattr(module.get_submodule(owner), attr, getattr(module.get_submodule(src_owner), src_attr))


def apply_ac(module):
    if RECOMPUTE != "none":
        apply_recompute(module, LAYER_CONTAINER, RECOMPUTE)


def apply_fsdp(module, mesh):
    if ZERO == 0 or mesh["dp"].size() == 1:
        return False
    for block in module.get_submodule(LAYER_CONTAINER).children():
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=ZERO >= 3)
    fully_shard(module, mesh=mesh["dp"], reshard_after_forward=ZERO >= 3)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", help="save a DCP checkpoint here at the end")
    ap.add_argument("--resume", help="load a DCP checkpoint before training")
    args = ap.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_world_size() != math.prod(MESH_SHAPE):
        raise SystemExit(f"this plan needs {math.prod(MESH_SHAPE)} ranks, got {dist.get_world_size()}")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, MESH_SHAPE, mesh_dim_names=("pp", "dp", "tp"))
    pp, dp = MESH_SHAPE[0], MESH_SHAPE[1]
    module = load_model_file(MODEL_FILE)
    loss_fn = getattr(module, "loss_fn", None) or default_loss
    torch.manual_seed(args.seed)
    model = module.build_model(**CONFIG).to(device)
    model.train()

    # 1. pipeline split (the chunks of this pipeline rank), 2. TP, 3. activation checkpointing, 4. FSDP
    pp_rank = mesh.get_local_rank("pp")
    chunks = list(range(pp_rank, len(STAGE_LAYERS), pp)) if pp > 1 else [0]
    parts = [build_stage(model, c) for c in chunks] if pp > 1 else [model]
    fsdp = False
    for part in parts:
        apply_tp(part, mesh)
        apply_ac(part)
        fsdp = apply_fsdp(part, mesh) or fsdp
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.SGD(params, lr=args.lr)

    schedule, tie_group = None, None
    if pp > 1:
        stages = [PipelineStage(part, c, len(STAGE_LAYERS), device, group=mesh["pp"].get_group())
                  for part, c in zip(parts, chunks)]
        if SCHEDULE == "interleaved":
            schedule = ScheduleInterleaved1F1B(stages, n_microbatches=NUM_MICROBATCHES, loss_fn=loss_fn)
        else:
            cls = ScheduleGPipe if SCHEDULE == "gpipe" else Schedule1F1B
            schedule = cls(stages[0], n_microbatches=NUM_MICROBATCHES, loss_fn=loss_fn)
        if TIED:  # first and last stage each own a copy of tied weights: sum their gradients
            ranks = mesh.mesh
            for first, last in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()):
                group = dist.new_group([first, last])
                if dist.get_rank() in (first, last):
                    tie_group = group

    if args.resume:
        for part in parts:
            state = get_model_state_dict(part)
            dcp.load(state, checkpoint_id=args.resume)
            set_model_state_dict(part, state)

    dp_rank, local = mesh.get_local_rank("dp"), GLOBAL_BATCH // dp
    for step in range(args.steps):
        batch = [x[dp_rank * local:(dp_rank + 1) * local].to(device)
                 for x in global_batch(module, model, step, args.seed)]
        optimizer.zero_grad(set_to_none=True)
        if schedule is not None:
            losses = []
            first, last = 0 in chunks, len(STAGE_LAYERS) - 1 in chunks
            if first and last:
                schedule.step(batch[0], target=batch[0], losses=losses)
            elif first:
                schedule.step(batch[0])
            elif last:
                schedule.step(target=batch[0], losses=losses)
            else:
                schedule.step()
            loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=device)
            pp_group = mesh["pp"].get_group()
            dist.broadcast(loss, src=dist.get_global_rank(pp_group, pp - 1), group=pp_group)
            if tie_group is not None:
                named = {n.replace("_checkpoint_wrapped_module.", ""): p for part in parts
                         for n, p in part.named_parameters()}
                for src, alias in TIED:
                    p = named.get(src, named.get(alias))
                    if p is not None and p.grad is not None:
                        g = p.grad.redistribute(p.grad.device_mesh, p.placements) if hasattr(p.grad, "redistribute") \
                            else p.grad
                        dist.all_reduce(g._local_tensor if hasattr(g, "_local_tensor") else g, group=tie_group)
                        p.grad = g
        else:
            loss = torch.zeros((), device=device)
            for i in range(NUM_MICROBATCHES):
                micro = [x[i * MICRO_BATCH:(i + 1) * MICRO_BATCH] for x in batch]
                part_loss = loss_fn(model(*micro), *micro) / NUM_MICROBATCHES
                part_loss.backward()
                loss += part_loss.detach()
        if not fsdp and dp > 1:  # ZeRO 0: average gradients over dp
            for p in params:
                if p.grad is not None:
                    g = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
                    dist.all_reduce(g, group=mesh["dp"].get_group())
                    g /= dp
        optimizer.step()
        if dp > 1:
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            loss /= dp
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)

    if args.checkpoint:
        state = {}
        for part in parts:
            state.update(get_model_state_dict(part))
        dcp.save(state, checkpoint_id=args.checkpoint)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''
