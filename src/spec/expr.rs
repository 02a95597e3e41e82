//! Integer expressions used by specs for derived values, constraints and launch geometry.
//!
//! The language is deliberately small: 64-bit integers, `+ - * / %`, comparisons
//! (`< <= > >= == !=`, giving 0 or 1), `&& || !`, parentheses, and the functions
//! `min(a, b)`, `max(a, b)` and `ceil_div(a, b)`. Variables are looked up by name.
//! Expressions are parsed once ([`Expr::parse`]) and evaluated many times.
//! (The one maintained crate for this, `evalexpr`, is AGPL-licensed, hence this module.)

use std::fmt;

/// A parse or evaluation error, with the expression text and the position where it went wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExprError {
    #[error("cannot parse `{text}` at column {column}: {message}")]
    Parse {
        text: String,
        column: usize,
        message: String,
    },
    #[error("`{text}`: unknown variable `{name}`{hint}")]
    UnknownVariable { text: String, name: String, hint: String },
    #[error("`{text}`: {message}")]
    Arithmetic { text: String, message: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
    And,
    Or,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Node {
    Int(i64),
    Var(String),
    Neg(Box<Node>),
    Not(Box<Node>),
    Bin(BinOp, Box<Node>, Box<Node>),
    Call(Func, Box<Node>, Box<Node>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Func {
    Min,
    Max,
    CeilDiv,
}

/// A parsed expression; `Display` prints the original text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expr {
    text: String,
    root: Node,
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Where [`Expr::eval`] finds variable values.
pub trait Scope {
    fn get(&self, name: &str) -> Option<i64>;
    /// Names in scope, used to suggest a fix for a misspelt variable.
    fn names(&self) -> Vec<String>;
}

impl Scope for std::collections::BTreeMap<String, i64> {
    fn get(&self, name: &str) -> Option<i64> {
        std::collections::BTreeMap::get(self, name).copied()
    }
    fn names(&self) -> Vec<String> {
        self.keys().cloned().collect()
    }
}

impl Expr {
    /// Parses `text`; the error names the column of the first problem.
    pub fn parse(text: &str) -> Result<Expr, ExprError> {
        let tokens = tokenize(text)?;
        let mut parser = Parser { text, tokens, pos: 0 };
        let root = parser.expr(0)?;
        if let Some((column, token)) = parser.tokens.get(parser.pos) {
            return Err(parser.error(*column, format!("unexpected `{token}`")));
        }
        Ok(Expr {
            text: text.to_string(),
            root,
        })
    }

    /// The original text.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Every variable the expression mentions, in order of first appearance.
    pub fn variables(&self) -> Vec<String> {
        fn walk(node: &Node, out: &mut Vec<String>) {
            match node {
                Node::Int(_) => {}
                Node::Var(name) => {
                    if !out.contains(name) {
                        out.push(name.clone());
                    }
                }
                Node::Neg(a) | Node::Not(a) => walk(a, out),
                Node::Bin(_, a, b) | Node::Call(_, a, b) => {
                    walk(a, out);
                    walk(b, out);
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.root, &mut out);
        out
    }

    /// Evaluates against `scope`; unknown variables, division by zero and overflow are errors.
    pub fn eval(&self, scope: &dyn Scope) -> Result<i64, ExprError> {
        self.eval_node(&self.root, scope)
    }

    /// Evaluates as a condition (non-zero is true).
    pub fn holds(&self, scope: &dyn Scope) -> Result<bool, ExprError> {
        Ok(self.eval(scope)? != 0)
    }

    fn arithmetic(&self, message: impl Into<String>) -> ExprError {
        ExprError::Arithmetic {
            text: self.text.clone(),
            message: message.into(),
        }
    }

    fn eval_node(&self, node: &Node, scope: &dyn Scope) -> Result<i64, ExprError> {
        let overflow = || self.arithmetic("integer overflow");
        Ok(match node {
            Node::Int(v) => *v,
            Node::Var(name) => scope.get(name).ok_or_else(|| ExprError::UnknownVariable {
                text: self.text.clone(),
                name: name.clone(),
                hint: suggestion(name, &scope.names()),
            })?,
            Node::Neg(a) => self.eval_node(a, scope)?.checked_neg().ok_or_else(overflow)?,
            Node::Not(a) => (self.eval_node(a, scope)? == 0) as i64,
            Node::Bin(BinOp::And, a, b) => (self.eval_node(a, scope)? != 0 && self.eval_node(b, scope)? != 0) as i64,
            Node::Bin(BinOp::Or, a, b) => (self.eval_node(a, scope)? != 0 || self.eval_node(b, scope)? != 0) as i64,
            Node::Bin(op, a, b) => {
                let (x, y) = (self.eval_node(a, scope)?, self.eval_node(b, scope)?);
                match op {
                    BinOp::Add => x.checked_add(y).ok_or_else(overflow)?,
                    BinOp::Sub => x.checked_sub(y).ok_or_else(overflow)?,
                    BinOp::Mul => x.checked_mul(y).ok_or_else(overflow)?,
                    BinOp::Div | BinOp::Rem if y == 0 => return Err(self.arithmetic("division by zero")),
                    BinOp::Div => x / y,
                    BinOp::Rem => x % y,
                    BinOp::Lt => (x < y) as i64,
                    BinOp::Le => (x <= y) as i64,
                    BinOp::Gt => (x > y) as i64,
                    BinOp::Ge => (x >= y) as i64,
                    BinOp::Eq => (x == y) as i64,
                    BinOp::Ne => (x != y) as i64,
                    BinOp::And | BinOp::Or => unreachable!("handled above (short-circuit)"),
                }
            }
            Node::Call(func, a, b) => {
                let (x, y) = (self.eval_node(a, scope)?, self.eval_node(b, scope)?);
                match func {
                    Func::Min => x.min(y),
                    Func::Max => x.max(y),
                    Func::CeilDiv if y <= 0 => return Err(self.arithmetic(format!("ceil_div by {y}"))),
                    Func::CeilDiv => x.checked_add(y - 1).ok_or_else(overflow)?.div_euclid(y),
                }
            }
        })
    }
}

/// " (did you mean `x`?)" when a known name is one or two edits away.
fn suggestion(name: &str, known: &[String]) -> String {
    fn distance(a: &str, b: &str) -> usize {
        let b: Vec<char> = b.chars().collect();
        let mut row: Vec<usize> = (0..=b.len()).collect();
        for (i, ca) in a.chars().enumerate() {
            let mut prev = row[0];
            row[0] = i + 1;
            for (j, cb) in b.iter().enumerate() {
                let cur = row[j + 1];
                row[j + 1] = (prev + (ca != *cb) as usize).min(row[j] + 1).min(cur + 1);
                prev = cur;
            }
        }
        row[b.len()]
    }
    known
        .iter()
        .map(|k| (distance(name, k), k))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map(|(_, k)| format!(" (did you mean `{k}`?)"))
        .unwrap_or_default()
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Int(i64),
    Ident(String),
    Op(&'static str),
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Token::Int(v) => write!(f, "{v}"),
            Token::Ident(s) => f.write_str(s),
            Token::Op(s) => f.write_str(s),
        }
    }
}

const OPERATORS: [&str; 19] = [
    "<=", ">=", "==", "!=", "&&", "||", "+", "-", "*", "/", "%", "<", ">", "!", "(", ")", ",", "=", "&",
];

fn tokenize(text: &str) -> Result<Vec<(usize, Token)>, ExprError> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let err = |column: usize, message: String| ExprError::Parse {
        text: text.to_string(),
        column: column + 1,
        message,
    };
    while i < bytes.len() {
        let c = bytes[i] as char;
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c.is_ascii_digit() {
            let start = i;
            while i < bytes.len() && (bytes[i] as char).is_ascii_digit() {
                i += 1;
            }
            let value = text[start..i]
                .parse()
                .map_err(|_| err(start, "number too large".into()))?;
            out.push((start, Token::Int(value)));
        } else if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < bytes.len() && ((bytes[i] as char).is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            out.push((start, Token::Ident(text[start..i].to_string())));
        } else {
            let op = OPERATORS
                .iter()
                .find(|op| text[i..].starts_with(**op))
                .ok_or_else(|| err(i, format!("unexpected character `{c}`")))?;
            if *op == "=" || *op == "&" {
                let want = if *op == "=" { "==" } else { "&&" };
                return Err(err(i, format!("`{op}` is not an operator; write `{want}`")));
            }
            out.push((i, Token::Op(op)));
            i += op.len();
        }
    }
    Ok(out)
}

struct Parser<'a> {
    text: &'a str,
    tokens: Vec<(usize, Token)>,
    pos: usize,
}

impl Parser<'_> {
    fn error(&self, column: usize, message: String) -> ExprError {
        ExprError::Parse {
            text: self.text.to_string(),
            column: column + 1,
            message,
        }
    }

    fn end_column(&self) -> usize {
        self.text.len()
    }

    fn peek_op(&self) -> Option<&'static str> {
        match self.tokens.get(self.pos) {
            Some((_, Token::Op(op))) => Some(op),
            _ => None,
        }
    }

    fn expect(&mut self, want: &'static str) -> Result<(), ExprError> {
        match self.tokens.get(self.pos) {
            Some((_, Token::Op(op))) if *op == want => {
                self.pos += 1;
                Ok(())
            }
            Some((column, token)) => Err(self.error(*column, format!("expected `{want}`, found `{token}`"))),
            None => Err(self.error(self.end_column(), format!("expected `{want}` at the end"))),
        }
    }

    /// Precedence climbing: `||` < `&&` < comparisons < `+ -` < `* / %` < unary.
    fn expr(&mut self, min_precedence: u8) -> Result<Node, ExprError> {
        let mut lhs = self.unary()?;
        while let Some(op) = self.peek_op() {
            let (precedence, bin) = match op {
                "||" => (1, BinOp::Or),
                "&&" => (2, BinOp::And),
                "==" => (3, BinOp::Eq),
                "!=" => (3, BinOp::Ne),
                "<" => (4, BinOp::Lt),
                "<=" => (4, BinOp::Le),
                ">" => (4, BinOp::Gt),
                ">=" => (4, BinOp::Ge),
                "+" => (5, BinOp::Add),
                "-" => (5, BinOp::Sub),
                "*" => (6, BinOp::Mul),
                "/" => (6, BinOp::Div),
                "%" => (6, BinOp::Rem),
                _ => break,
            };
            if precedence < min_precedence {
                break;
            }
            self.pos += 1;
            let rhs = self.expr(precedence + 1)?;
            lhs = Node::Bin(bin, Box::new(lhs), Box::new(rhs));
        }
        Ok(lhs)
    }

    fn unary(&mut self) -> Result<Node, ExprError> {
        let Some((column, token)) = self.tokens.get(self.pos).cloned() else {
            return Err(self.error(self.end_column(), "expression ends too early".into()));
        };
        self.pos += 1;
        match token {
            Token::Int(v) => Ok(Node::Int(v)),
            Token::Op("-") => Ok(Node::Neg(Box::new(self.unary()?))),
            Token::Op("!") => Ok(Node::Not(Box::new(self.unary()?))),
            Token::Op("(") => {
                let inner = self.expr(0)?;
                self.expect(")")?;
                Ok(inner)
            }
            Token::Ident(name) if self.peek_op() == Some("(") => {
                let func = match name.as_str() {
                    "min" => Func::Min,
                    "max" => Func::Max,
                    "ceil_div" => Func::CeilDiv,
                    _ => {
                        return Err(self.error(column, format!("unknown function `{name}` (known: min, max, ceil_div)")))
                    }
                };
                self.pos += 1;
                let a = self.expr(0)?;
                self.expect(",")?;
                let b = self.expr(0)?;
                self.expect(")")?;
                Ok(Node::Call(func, Box::new(a), Box::new(b)))
            }
            Token::Ident(name) => Ok(Node::Var(name)),
            other => Err(self.error(column, format!("unexpected `{other}`"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn eval(text: &str, vars: &[(&str, i64)]) -> Result<i64, ExprError> {
        let scope: BTreeMap<String, i64> = vars.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        Expr::parse(text)?.eval(&scope)
    }

    #[test]
    fn arithmetic_and_precedence() {
        assert_eq!(eval("1 + 2 * 3", &[]), Ok(7));
        assert_eq!(eval("(1 + 2) * 3", &[]), Ok(9));
        assert_eq!(eval("10 - 4 - 3", &[]), Ok(3));
        assert_eq!(eval("17 / 5 * 5 + 17 % 5", &[]), Ok(17));
        assert_eq!(eval("-3 + 5", &[]), Ok(2));
        assert_eq!(
            eval(
                "(block_m / thread_m) * (block_n / thread_n)",
                &[("block_m", 128), ("thread_m", 8), ("block_n", 64), ("thread_n", 4)]
            ),
            Ok(256)
        );
    }

    #[test]
    fn comparisons_and_logic() {
        assert_eq!(eval("3 < 4 && 4 <= 4", &[]), Ok(1));
        assert_eq!(eval("3 > 4 || 2 != 2", &[]), Ok(0));
        assert_eq!(eval("!0 && !(1 == 2)", &[]), Ok(1));
        assert_eq!(eval("1 + 1 == 2", &[]), Ok(1));
        // short-circuit: the right side is not evaluated, so no division by zero
        assert_eq!(eval("0 && 1 / 0", &[]), Ok(0));
        assert_eq!(eval("c == 0 || C <= 4096", &[("c", 0)]), Ok(1));
    }

    #[test]
    fn functions() {
        assert_eq!(eval("ceil_div(100, 32)", &[]), Ok(4));
        assert_eq!(eval("ceil_div(96, 32)", &[]), Ok(3));
        assert_eq!(eval("ceil_div(0, 32)", &[]), Ok(0));
        assert_eq!(eval("min(3, max(7, 5))", &[]), Ok(3));
        assert_eq!(
            eval(
                "min(ceil_div(N, 256), num_sms * 4)",
                &[("N", 1 << 20), ("num_sms", 132)]
            ),
            Ok(528)
        );
    }

    #[test]
    fn errors_name_the_problem() {
        let e = eval("block_m * thred_m", &[("block_m", 1), ("thread_m", 2)]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "`block_m * thred_m`: unknown variable `thred_m` (did you mean `thread_m`?)"
        );
        assert!(matches!(eval("1 / 0", &[]), Err(ExprError::Arithmetic { .. })));
        assert!(matches!(eval("ceil_div(1, 0)", &[]), Err(ExprError::Arithmetic { .. })));
        let e = Expr::parse("a = 3").unwrap_err();
        assert!(e.to_string().contains("write `==`"), "{e}");
        let e = Expr::parse("(1 + 2").unwrap_err();
        assert!(e.to_string().contains("expected `)`"), "{e}");
        let e = Expr::parse("1 + ").unwrap_err();
        assert!(e.to_string().contains("ends too early"), "{e}");
        let e = Expr::parse("sqrt(4, 2)").unwrap_err();
        assert!(e.to_string().contains("unknown function `sqrt`"), "{e}");
        let e = Expr::parse("1 2").unwrap_err();
        assert_eq!(e.to_string(), "cannot parse `1 2` at column 3: unexpected `2`");
        assert!(matches!(
            eval("9223372036854775807 + 1", &[]),
            Err(ExprError::Arithmetic { .. })
        ));
    }

    #[test]
    fn variables_are_listed_once() {
        let e = Expr::parse("a * b + a - min(c, 2)").unwrap();
        assert_eq!(e.variables(), vec!["a", "b", "c"]);
    }
}
