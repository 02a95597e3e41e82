//! The stage record: one stage of the megakernel's table as the template's `struct Stage` reads
//! it (its kinds, flags and epilogue codes, its 160 bytes), and the names the timeline gives
//! the stages.

use crate::ops::Epilogue;

/// What a stage does (`StageKind` of the template).
pub(super) const STAGE_EMBED: i32 = 0;
pub(super) const STAGE_MATVEC: i32 = 1;
pub(super) const STAGE_ATTENTION: i32 = 2;
/// `StageFlags` of the template.
pub(super) const FLAG_LAYERNORM: i32 = 1;
pub(super) const FLAG_ARGMAX: i32 = 2;
pub(super) const FLAG_MLP: i32 = 4;
pub(super) const FLAG_INIT_ACC: i32 = 8;
pub(super) const FLAG_INPUT_ACC: i32 = 16;
pub(super) const FLAG_RESIDUAL_ACC: i32 = 32;

/// One stage of the table, laid out as the template's `struct Stage` (160 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub struct StageRecord {
    pub kind: i32,
    pub first_task: i32,
    pub tasks: i32,
    pub wait_stage: i32,
    pub wait_count: i32,
    pub n: i32,
    pub k: i32,
    pub cols: i32,
    pub flags: i32,
    pub epilogue: i32,
    pub ws_offset: i32,
    pub op: i32,
    pub n2: i32,
    /// Keeps the pointers 8-byte aligned and the record a whole number of 16-byte pieces.
    pub pad: i32,
    pub weight: u64,
    pub bias: u64,
    pub input: u64,
    pub out: u64,
    pub residual: u64,
    pub gamma: u64,
    pub beta: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub aux: u64,
    pub weight2: u64,
    pub bias2: u64,
    pub acc: u64,
}

const _: () = assert!(std::mem::size_of::<StageRecord>() == 160);

impl StageRecord {
    pub fn bytes(&self) -> Vec<u8> {
        let ints = [
            self.kind,
            self.first_task,
            self.tasks,
            self.wait_stage,
            self.wait_count,
            self.n,
            self.k,
            self.cols,
            self.flags,
            self.epilogue,
            self.ws_offset,
            self.op,
            self.n2,
            self.pad,
        ];
        let ptrs = [
            self.weight,
            self.bias,
            self.input,
            self.out,
            self.residual,
            self.gamma,
            self.beta,
            self.k_cache,
            self.v_cache,
            self.aux,
            self.weight2,
            self.bias2,
            self.acc,
        ];
        ints.iter()
            .flat_map(|v| v.to_ne_bytes())
            .chain(ptrs.iter().flat_map(|v| v.to_ne_bytes()))
            .collect()
    }

    /// The count its counter reaches when the stage is complete: one per task, except
    /// attention, which counts a head when its last chunk has combined the partial results.
    pub(super) fn completion(&self, heads: usize) -> usize {
        if self.kind == STAGE_ATTENTION {
            heads
        } else {
            self.tasks as usize
        }
    }
}

/// The names the timeline gives the stages (index = `StageRecord::op`).
pub const STAGE_OPS: [&str; 8] = [
    "embed",
    "qkv",
    "attention",
    "attn_proj",
    "fc",
    "fc_proj",
    "lm_head",
    "mlp",
];

/// The template's `Epilogue` of a matmul's epilogue.
pub(super) fn epilogue_code(epilogue: Epilogue) -> i32 {
    match epilogue {
        Epilogue::None => 0,
        Epilogue::Bias => 1,
        Epilogue::BiasGelu => 2,
        Epilogue::BiasResidual => 3,
        Epilogue::Qkv => 4,
        // Refused before (a decode stage standardizes its input with its own layernorm pass).
        Epilogue::LnBias | Epilogue::LnBiasGelu | Epilogue::LnQkv => epilogue_code(epilogue.after_product()),
    }
}
