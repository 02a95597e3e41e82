//! Choosing the next token from a row of logits: greedy (argmax), temperature, top-k and top-p
//! (nucleus) sampling. The draw itself is [`crate::ops::draw`]'s: a pure function of the row,
//! the parameters and a key (seed, sequence, position), computed the same way on the CPU and
//! in the GPU's `sample` kernels, so one seed gives the same tokens on every backend. This
//! module adapts it to the model's errors.

use super::error::{ModelError, Result};
use crate::ops::draw::{self, DrawError};
pub use crate::ops::draw::{DrawKey, SamplingParams};

impl From<DrawError> for ModelError {
    fn from(e: DrawError) -> Self {
        ModelError::Sampling(e.to_string())
    }
}

/// Index of the largest logit (the first one on ties). NaN is an error.
pub fn argmax(logits: &[f32]) -> Result<u32> {
    Ok(draw::argmax(logits)?)
}

/// The token drawn from `logits` (see [`crate::ops::draw::draw`]).
pub fn sample(logits: &[f32], params: &SamplingParams, key: DrawKey) -> Result<u32> {
    Ok(draw::draw(logits, params, key)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_become_model_errors_naming_the_token() {
        let e = argmax(&[0.0, f32::NAN]).unwrap_err().to_string();
        assert!(e.contains("NaN") && e.contains("token 1"), "{e}");
        let bad = SamplingParams {
            temperature: -1.0,
            top_k: 0,
            top_p: 1.0,
        };
        let key = DrawKey {
            seed: 0,
            sequence: 0,
            position: 0,
        };
        assert!(sample(&[0.0], &bad, key)
            .unwrap_err()
            .to_string()
            .contains("temperature"));
    }
}
