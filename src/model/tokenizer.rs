//! The GPT-2 byte-level BPE tokenizer (OpenAI's `r50k_base`, 50257 tokens; the ranks ship inside
//! the `tiktoken-rs` crate, so nothing is downloaded). Encoding then decoding gives back the
//! exact input text; decoding checks every id; [`StreamDecoder`] turns a token stream into text
//! without splitting multi-byte UTF-8 characters across tokens.

use tiktoken_rs::CoreBPE;

use super::error::{ModelError, Result};

/// `<|endoftext|>`, GPT-2's only special token.
pub const EOT_TOKEN: u32 = 50256;
/// Number of token ids in GPT-2's vocabulary (0..=50256).
pub const GPT2_VOCAB_SIZE: usize = 50257;
/// The text of the end-of-text token.
pub const EOT_TEXT: &str = "<|endoftext|>";

/// GPT-2 BPE tokenizer. Cheap to clone (the rank tables are a process-wide singleton).
#[derive(Clone, Copy)]
pub struct Tokenizer {
    bpe: &'static CoreBPE,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tokenizer(gpt2 / r50k_base)")
    }
}

impl Tokenizer {
    /// The GPT-2 tokenizer (first call builds the tables, ~100 ms).
    pub fn gpt2() -> Self {
        Tokenizer {
            bpe: tiktoken_rs::r50k_base_singleton(),
        }
    }

    /// Encode text; the literal `<|endoftext|>` becomes [`EOT_TOKEN`] (as the Hugging Face GPT-2
    /// tokenizer does).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_with_special_tokens(text)
    }

    /// Encode text treating `<|endoftext|>` as ordinary characters.
    pub fn encode_ordinary(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// The raw bytes of a token sequence; an id outside the vocabulary is an error naming it.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= GPT2_VOCAB_SIZE) {
            return Err(ModelError::DecodeToken {
                token: bad,
                max: EOT_TOKEN,
            });
        }
        self.bpe.decode_bytes(ids).map_err(|e| ModelError::DecodeToken {
            token: e.token,
            max: EOT_TOKEN,
        })
    }

    /// Decode ids to text. Ids outside the vocabulary are an error; byte sequences that are not
    /// valid UTF-8 (a character cut between tokens) come out as U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    /// Decode ids that must form valid UTF-8 (error otherwise).
    pub fn decode_strict(&self, ids: &[u32]) -> Result<String> {
        String::from_utf8(self.decode_bytes(ids)?)
            .map_err(|e| ModelError::Tokenizer(format!("ids {ids:?} do not decode to valid UTF-8: {e}")))
    }
}

/// Incremental detokenizer: push ids one at a time, get back the text that is complete so far
/// (bytes of a UTF-8 character split across tokens are held until the character completes).
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add one token; returns the newly completed text (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.pending.extend(tok.decode_bytes(&[id])?);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return Ok(out);
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..good]).expect("checked prefix"));
                    match e.error_len() {
                        // Incomplete character at the end: keep it for the next token.
                        None => {
                            self.pending.drain(..good);
                            return Ok(out);
                        }
                        // Invalid bytes: emit a replacement character and go on.
                        Some(n) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..good + n);
                        }
                    }
                }
            }
        }
    }

    /// Flush whatever is held (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_ids() {
        let t = Tokenizer::gpt2();
        assert_eq!(t.encode("Hello, world"), vec![15496, 11, 995]);
        assert_eq!(t.decode(&[15496, 11, 995]).unwrap(), "Hello, world");
        assert_eq!(t.encode("<|endoftext|>"), vec![EOT_TOKEN]);
        assert!(t.encode_ordinary("<|endoftext|>").len() > 1);
        let err = t.decode(&[50257]).unwrap_err().to_string();
        assert!(err.contains("50257"), "{err}");
    }

    #[test]
    fn stream_decoder_holds_split_characters() {
        let t = Tokenizer::gpt2();
        let text = "naïve 日本語 🦀!";
        let ids = t.encode(text);
        let mut d = StreamDecoder::new();
        let mut out = String::new();
        for id in ids {
            let piece = d.push(&t, id).unwrap();
            assert!(!piece.contains('\u{FFFD}'));
            out.push_str(&piece);
        }
        out.push_str(&d.finish());
        assert_eq!(out, text);
    }
}
