//! Tests of the stage table: lowering a greedy decode plan, cutting columns, the schedule check.

use super::*;

/// The greedy decode plan of a `layers`-layer model as the GPU backend builds it, with
/// made-up pointers (each buffer its own range).
fn plan(layers: usize, batch: usize, c: usize, n_head: usize, vp: usize) -> Vec<PlanOp> {
    let (b, c32) = (batch as i32, c as i32);
    let p = ArgValue::Ptr;
    let i = |v: usize| ArgValue::I32(v as i32);
    let (x, y, ln, qkv, att, fc, logits, ids, next, next_copy) = (
        p(1 << 20),
        p(2 << 20),
        p(3 << 20),
        p(4 << 20),
        p(5 << 20),
        p(6 << 20),
        p(7 << 20),
        p(8 << 20),
        p(9 << 20),
        p(10 << 20),
    );
    let w = |l: usize, k: usize| p(((100 + l) << 24) as u64 + (k << 16) as u64);
    let op = |role: &str, op: &str, epilogue: Epilogue, args: Vec<ArgValue>, layer: Option<usize>| PlanOp {
        role: role.into(),
        op: op.into(),
        epilogue,
        args,
        layer,
    };
    let matmul = |out, inp, weight, bias, residual, n: usize, k: usize| {
        vec![
            out,
            inp,
            weight,
            bias,
            residual,
            p(0),
            ArgValue::I32(b),
            i(n),
            i(k),
            i(1),
            i(n_head),
        ]
    };
    let mut ops = vec![op(
        "embedding",
        "encoder",
        Epilogue::None,
        vec![
            x,
            ids,
            w(0, 0),
            w(0, 1),
            ArgValue::I32(b),
            i(1),
            ArgValue::I32(c32),
            i(5),
        ],
        None,
    )];
    let (mut cur, mut other) = (x, y);
    for l in 0..layers {
        let layer = Some(l);
        ops.push(op(
            "layernorm",
            "layernorm",
            Epilogue::None,
            vec![ln, cur, w(l, 2), w(l, 3), i(batch), i(c)],
            layer,
        ));
        ops.push(op(
            "qkv",
            "matmul",
            Epilogue::Qkv,
            matmul(qkv, ln, w(l, 4), w(l, 5), p(0), 3 * c, c),
            layer,
        ));
        ops.push(op(
            "attention",
            "attention_decode",
            Epilogue::None,
            vec![
                att,
                qkv,
                p(0),
                p(0),
                w(l, 20),
                w(l, 21),
                p(0),
                i(batch),
                i(n_head),
                i(6),
                i(1024),
                i(c / n_head),
                ArgValue::F32(0.125),
            ],
            layer,
        ));
        ops.push(op(
            "attn_proj",
            "matmul",
            Epilogue::BiasResidual,
            matmul(other, att, w(l, 6), w(l, 7), cur, c, c),
            layer,
        ));
        std::mem::swap(&mut cur, &mut other);
        ops.push(op(
            "layernorm",
            "layernorm",
            Epilogue::None,
            vec![ln, cur, w(l, 8), w(l, 9), i(batch), i(c)],
            layer,
        ));
        ops.push(op(
            "fc",
            "matmul",
            Epilogue::BiasGelu,
            matmul(fc, ln, w(l, 10), w(l, 11), p(0), 4 * c, c),
            layer,
        ));
        ops.push(op(
            "fc_proj",
            "matmul",
            Epilogue::BiasResidual,
            matmul(other, fc, w(l, 12), w(l, 13), cur, c, 4 * c),
            layer,
        ));
        std::mem::swap(&mut cur, &mut other);
    }
    ops.push(op(
        "layernorm",
        "layernorm",
        Epilogue::None,
        vec![ln, cur, w(99, 0), w(99, 1), i(batch), i(c)],
        None,
    ));
    ops.push(op(
        "lm_head",
        "matmul",
        Epilogue::None,
        matmul(logits, ln, w(0, 0), p(0), p(0), vp, c),
        None,
    ));
    ops.push(op(
        "argmax",
        "argmax",
        Epilogue::None,
        vec![next, next_copy, logits, i(batch), i(vp - 47), i(vp)],
        None,
    ));
    ops
}

fn geometry(elem_bytes: usize) -> Geometry {
    Geometry {
        grid: 132,
        slot_bytes: 48 * 1024,
        elem_bytes,
        max_rows: 8,
        input_row_elems: 4 * 768,
        norm_row_elems: 512 * 16 / elem_bytes,
        head_dim: 64,
        col_unit: 16,
        chunk_rows: 1,
    }
}

#[test]
fn gpt2_small_lowers_to_one_stage_per_fused_op_about_a_wave_each() {
    let ops = plan(12, 1, 768, 12, 50304);
    let lowered = lower(&ops, &geometry(2), None).unwrap();
    check_schedule(&lowered).unwrap();
    let names: Vec<&str> = lowered.stages.iter().map(|s| STAGE_OPS[s.op as usize]).collect();
    assert_eq!(names.len(), 1 + 12 * 5 + 1);
    assert_eq!(
        &names[..7],
        ["embed", "qkv", "attention", "attn_proj", "fc", "fc_proj", "qkv"]
    );
    assert_eq!(names.last(), Some(&"lm_head"));
    // layernorms fused into qkv, fc and the LM head; the append into qkv; argmax into the head
    let s = &lowered.stages;
    assert_eq!(s[1].flags, FLAG_LAYERNORM);
    assert_eq!((s[1].epilogue, s[1].n, s[1].k), (4, 2304, 768));
    assert_ne!(s[1].k_cache, 0);
    assert_eq!(
        s[1].input,
        1 << 20,
        "the qkv stage normalises the residual stream itself"
    );
    assert_eq!(s[4].flags, FLAG_LAYERNORM);
    assert_eq!(s[4].epilogue, 2);
    assert_eq!(s[5].flags, 0);
    assert_eq!(s[5].epilogue, 3);
    assert_eq!(s.last().unwrap().flags, FLAG_LAYERNORM | FLAG_ARGMAX);
    // one wave where the weights fit a slot: 2304 columns / 132 blocks -> 18 per task
    assert_eq!((s[1].cols, s[1].tasks), (18, 128));
    // fc_proj rows are 6 KB: 6 columns per task, 128 tasks
    assert_eq!((s[5].cols, s[5].tasks), (6, 128));
    // the LM head streams several waves of slot-sized tasks, each a whole number of passes
    // of the block's 16 warps: 32 columns (the slot's cap) are 12 waves of 2 passes
    let head = s.last().unwrap();
    assert_eq!((head.cols, head.tasks), (32, 1572), "{head:?}");
    let mut narrow = geometry(2);
    narrow.col_unit = 8;
    let wide = lower(&ops, &narrow, None).unwrap();
    let head = wide.stages.last().unwrap();
    assert_eq!(
        (head.cols, head.tasks),
        (32, 1572),
        "8 columns a pass: 12 waves of 4 passes beat 24 waves of 2 (16 columns) and 16 of 3 (24 columns)"
    );
    // attention: 11 chunks of the cache per head fill 132 blocks
    assert_eq!((s[2].kind, s[2].cols, s[2].tasks), (STAGE_ATTENTION, 11, 132));
    assert_eq!(
        s[3].wait_count, 12,
        "attn_proj waits for the 12 heads, not the 132 chunks"
    );
    assert_eq!(lowered.counters, s.len() + 12 + 2);
    // attention's partials, then the argmax partials (a float2 a block and row), then a top-k
    // draw's heads (a float2 a row and LM-head task)
    assert_eq!(lowered.workspace_floats, 132 * 66 + 132 * 8 * 2 + 1572 * 8 * 2);
    // tasks numbered in order, each stage waiting for the previous one, complete
    for w in s.windows(2) {
        assert_eq!(w[1].first_task, w[0].first_task + w[0].tasks);
    }
    assert_eq!(lowered.layers[1], Some(0));
    assert_eq!(lowered.layers[60], Some(11));
}

#[test]
fn every_stage_points_where_its_ops_arguments_point() {
    // The pointers of `plan`: the buffers, and weight k of layer l.
    let buf = |n: u64| n << 20;
    let w = |l: u64, k: u64| ((100 + l) << 24) + (k << 16);
    let (x, y, qkv, att, fc, logits) = (buf(1), buf(2), buf(4), buf(5), buf(6), buf(7));
    let lowered = lower(&plan(1, 2, 768, 12, 50304), &geometry(2), None).unwrap();
    let s = &lowered.stages;
    let names: Vec<&str> = s.iter().map(|s| STAGE_OPS[s.op as usize]).collect();
    assert_eq!(
        names,
        ["embed", "qkv", "attention", "attn_proj", "fc", "fc_proj", "lm_head"]
    );
    let pointers = |s: &StageRecord| {
        [
            s.out, s.input, s.weight, s.bias, s.residual, s.gamma, s.beta, s.k_cache, s.v_cache, s.aux,
        ]
    };
    // out, input, weight, bias, residual, gamma, beta, k_cache, v_cache, aux
    let want = [
        [x, 0, w(0, 0), 0, 0, 0, 0, 0, 0, w(0, 1)],
        [qkv, x, w(0, 4), w(0, 5), 0, w(0, 2), w(0, 3), w(0, 20), w(0, 21), 0],
        [att, qkv, 0, 0, 0, 0, 0, w(0, 20), w(0, 21), 0],
        [y, att, w(0, 6), w(0, 7), x, 0, 0, 0, 0, 0],
        [fc, y, w(0, 10), w(0, 11), 0, w(0, 8), w(0, 9), 0, 0, 0],
        [x, fc, w(0, 12), w(0, 13), y, 0, 0, 0, 0, 0],
        [logits, x, w(0, 0), 0, 0, w(99, 0), w(99, 1), 0, 0, 0],
    ];
    for ((stage, want), name) in s.iter().zip(want).zip(names) {
        assert_eq!(pointers(stage), want, "{name}");
    }
    assert_eq!((s[0].n, s[1].n, s[1].k, s[5].n, s[5].k), (768, 2304, 768, 768, 3072));
}

#[test]
fn a_slice_counts_its_cache_chunks_for_the_whole_batch() {
    // One sequence alone cuts each head's cache into 11 chunks to fill 132 blocks; as a
    // slice of a batch of 4 it cuts 2, as the whole batch does, so its keys are summed alike.
    let attention = |batch: usize, chunk_rows: usize| {
        let geo = Geometry {
            chunk_rows,
            ..geometry(2)
        };
        let lowered = lower(&plan(2, batch, 768, 12, 50304), &geo, None).unwrap();
        check_schedule(&lowered).unwrap();
        let s = lowered.stages[2];
        assert_eq!(s.kind, STAGE_ATTENTION);
        (s.cols, s.tasks)
    };
    assert_eq!(attention(1, 1), (11, 132));
    assert_eq!(attention(4, 1), (2, 96));
    assert_eq!(attention(1, 4), (2, 24));
    assert_eq!(
        attention(4, 2),
        attention(4, 1),
        "chunk_rows below the batch counts the batch"
    );
}

#[test]
fn stage_records_are_the_templates_160_bytes() {
    let record = StageRecord {
        kind: 1,
        n: 7,
        weight: 0x1122_3344_5566_7788,
        aux: 9,
        n2: 5,
        acc: 11,
        ..Default::default()
    };
    let bytes = record.bytes();
    assert_eq!(bytes.len(), 160);
    assert_eq!(&bytes[0..4], &1i32.to_ne_bytes());
    assert_eq!(&bytes[20..24], &7i32.to_ne_bytes());
    assert_eq!(&bytes[48..52], &5i32.to_ne_bytes());
    assert_eq!(&bytes[56..64], &0x1122_3344_5566_7788u64.to_ne_bytes());
    assert_eq!(&bytes[128..136], &9u64.to_ne_bytes());
    assert_eq!(&bytes[152..160], &11u64.to_ne_bytes());
}

#[test]
fn unsafe_schedules_are_refused_with_the_stage_named() {
    let good = lower(&plan(2, 8, 768, 12, 50304), &geometry(4), None).unwrap();
    check_schedule(&good).unwrap();
    let refused = |edit: &dyn Fn(&mut Lowered)| {
        let mut bad = good.clone();
        edit(&mut bad);
        check_schedule(&bad).unwrap_err().to_string()
    };
    let e = refused(&|l| l.stages[3].wait_stage = 5);
    assert!(e.contains("stage 3 (attn_proj)") && e.contains("not earlier"), "{e}");
    let e = refused(&|l| l.stages[3].wait_count += 1);
    assert!(e.contains("only ever counts"), "{e}");
    let e = refused(&|l| l.stages[2].first_task += 1);
    assert!(e.contains("stage order"), "{e}");
    let e = refused(&|l| l.stages[4].wait_stage = -1);
    assert!(e.contains("waits for nothing"), "{e}");
    let e = refused(&|l| l.stages[4].tasks = 0);
    assert!(e.contains("no tasks"), "{e}");
    let e = refused(&|l| {
        let last = l.stages.len() - 1;
        l.stages[last].flags = 0;
        l.stages[1].flags |= FLAG_ARGMAX;
    });
    assert!(e.contains("must be the last"), "{e}");
}

#[test]
fn plans_the_kernel_cannot_run_are_refused_with_the_fix() {
    // f32 rows of the 1.5B model's fc projection (4 * 1600 * 4 bytes) outgrow a 16 KB slot
    let mut geo = geometry(4);
    geo.slot_bytes = 16 * 1024;
    geo.input_row_elems = 4 * 1600;
    geo.norm_row_elems = 2048;
    let e = lower(&plan(1, 1, 1600, 25, 50304), &geo, None).unwrap_err().to_string();
    assert!(
        e.contains("fc_proj") && e.contains("25600 bytes") && e.contains("slot_kib"),
        "{e}"
    );
    // the unfused plan's standalone gelu
    let mut ops = plan(1, 1, 768, 12, 50304);
    let fc = ops.iter().position(|o| o.role == "fc").unwrap();
    ops.insert(
        fc + 1,
        PlanOp {
            role: "gelu".into(),
            op: "gelu".into(),
            epilogue: Epilogue::None,
            args: vec![],
            layer: Some(0),
        },
    );
    let e = lower(&ops, &geometry(2), None).unwrap_err().to_string();
    assert!(e.contains("gelu") && e.contains("--decode-engine graph"), "{e}");
    // more sequences than the point is compiled for
    let mut geo = geometry(2);
    geo.max_rows = 1;
    let e = lower(&plan(1, 8, 768, 12, 50304), &geo, None).unwrap_err().to_string();
    assert!(e.contains("max_rows"), "{e}");
    // more stages than the kernel's table holds (5 a layer)
    let e = lower(&plan(103, 1, 768, 12, 50304), &geometry(2), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("517 stages") && e.contains("at most 512"), "{e}");
    // a head size the kernel is not compiled for
    let e = lower(&plan(1, 1, 768, 16, 50304), &geometry(2), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("head_dim 64"), "{e}");
}

/// The fusion of `plan`'s MLPs, with each layer's fc projection weight (`w(l, 12)`) transposed.
fn mlp_fusion(layers: usize) -> MlpFusion {
    MlpFusion {
        acc: 0xacc << 20,
        transposed: (0..layers)
            .map(|l| (((100 + l) << 24) as u64 + (12 << 16), (0x7700 + l as u64) << 20))
            .collect(),
    }
}

#[test]
fn fused_mlps_take_one_stage_a_layer_and_the_stream_goes_through_acc() {
    let mlp = mlp_fusion(12);
    let lowered = lower(&plan(12, 1, 768, 12, 50304), &geometry(2), Some(&mlp)).unwrap();
    check_schedule(&lowered).unwrap();
    let s = &lowered.stages;
    let names: Vec<&str> = s.iter().map(|s| STAGE_OPS[s.op as usize]).collect();
    assert_eq!(names.len(), 1 + 12 * 4 + 1);
    assert_eq!(&names[..6], ["embed", "qkv", "attention", "attn_proj", "mlp", "qkv"]);
    let (attn_proj, fused, next_qkv, next_proj) = (&s[3], &s[4], &s[5], &s[7]);
    // the attention projection stores x' and starts acc at x' + the fc projection's bias
    assert_eq!(
        attn_proj.flags, FLAG_INIT_ACC,
        "layer 0 reads its residual from the embedding"
    );
    assert_eq!((attn_proj.acc, attn_proj.bias2), (mlp.acc, (100 << 24) + (13 << 16)));
    // the MLP: layernorm of x', fc rows and the transposed projection's rows in half a slot each
    assert_eq!(fused.flags, FLAG_LAYERNORM | FLAG_MLP);
    assert_eq!((fused.n, fused.k, fused.n2), (3072, 768, 768));
    assert_eq!((fused.weight, fused.weight2), ((100 << 24) + (10 << 16), 0x7700 << 20));
    assert_eq!(fused.input, attn_proj.out);
    assert_eq!((fused.acc, fused.out), (mlp.acc, 0));
    // 24 KiB a half holds 16 rows of 1.5 KB; 12 take as many waves of one pass
    assert_eq!((fused.cols, fused.tasks), (12, 256));
    // the next layer normalises and adds x'' from acc, never from the buffer it replaces
    assert_eq!(next_qkv.flags, FLAG_LAYERNORM | FLAG_INPUT_ACC);
    assert_eq!((next_qkv.input, next_qkv.acc), (0, mlp.acc));
    assert_eq!(next_proj.flags, FLAG_RESIDUAL_ACC | FLAG_INIT_ACC);
    assert_eq!((next_proj.residual, next_proj.acc), (0, mlp.acc));
    let head = s.last().unwrap();
    assert_eq!(head.flags, FLAG_LAYERNORM | FLAG_ARGMAX | FLAG_INPUT_ACC);
    assert_eq!(head.wait_stage as usize, s.len() - 2);
    // without the transposed weight of a layer, that layer keeps its two stages
    let mut partial = mlp.clone();
    partial.transposed.remove(&(((100 + 5) << 24) as u64 + (12 << 16)));
    let lowered = lower(&plan(12, 1, 768, 12, 50304), &geometry(2), Some(&partial)).unwrap();
    check_schedule(&lowered).unwrap();
    assert_eq!(lowered.stages.len(), 1 + 12 * 4 + 1 + 1);
    let ops: Vec<&str> = lowered.stages.iter().map(|s| STAGE_OPS[s.op as usize]).collect();
    assert_eq!(ops.iter().filter(|o| **o == "fc_proj").count(), 1);
    // staged rows too short to hold a row's f32 sums after the input: the MLPs stay unfused
    // (and then their fc projections' 4C-wide inputs do not fit either)
    let mut short = geometry(2);
    short.input_row_elems = 768 + 2 * 768 - 8;
    let e = lower(&plan(2, 1, 768, 12, 50304), &short, Some(&mlp_fusion(2)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("fc_proj"), "{e}");
    // a matmul reading x'' without a layernorm cannot take it from acc: refused with the fix
    let mut bad = plan(2, 1, 768, 12, 50304);
    let second_norm = bad
        .iter()
        .rposition(|o| o.role == "layernorm" && o.layer == Some(1))
        .unwrap();
    let first_norm = bad
        .iter()
        .position(|o| o.role == "layernorm" && o.layer == Some(1))
        .unwrap();
    let x = bad[first_norm].args[1];
    assert!(first_norm < second_norm);
    bad.remove(first_norm);
    bad[first_norm].args[1] = x; // layer 1's qkv reads x'' itself
    let e = lower(&bad, &geometry(2), Some(&mlp_fusion(2))).unwrap_err().to_string();
    assert!(e.contains("through a layernorm") && e.contains("fuse_mlp = 0"), "{e}");
    assert!(lower(&bad, &geometry(2), None).is_ok(), "unfused, the plan lowers");
    // layer 5's qkv still reads acc; its fc projection stores x'', which layer 6 reads as is
    let fc_proj = ops.iter().position(|o| *o == "fc_proj").unwrap();
    let after = &lowered.stages[fc_proj + 1];
    assert_eq!(after.flags, FLAG_LAYERNORM, "{after:?}");
    assert_eq!(lowered.stages[fc_proj].flags, 0);
}

/// The constants the host shares with the template (each written in both) agree.
#[test]
fn the_template_defines_the_hosts_constants() {
    let read = |file: &str| {
        std::fs::read_to_string(format!("{}/templates/decode/{file}", env!("CARGO_MANIFEST_DIR"))).unwrap()
    };
    let (megakernel, matvec) = (read("megakernel.cu.tera"), read("matvec.cu.tera"));
    for (source, name, value) in [
        (&megakernel, "MAX_TASK_COLS", MAX_TASK_COLS),
        (&megakernel, "MAX_STAGES", MAX_STAGES),
        (&matvec, "ACC_SPREAD", ACC_SPREAD),
    ] {
        let define = format!("#define {name} {value}");
        assert!(
            source
                .lines()
                .any(|l| l == define || l.starts_with(&format!("{define} "))),
            "the template must read `{define}`"
        );
    }
}
