//! Exact arithmetic expressions: `+ - * /` and parentheses over
//! non-negative integer literals, parsed by recursive descent and evaluated
//! in rational arithmetic with checked `i128` operations. The `countdown`
//! verifier is built on it; anything it cannot fully account for (overflow,
//! division by zero, a stray character, too long, too deep) is an error, so
//! a policy cannot find reward in a verifier's corners.

/// The longest completion the verifier reads, in bytes; longer earns 0.
pub const MAX_LEN: usize = 256;

/// The deepest parenthesis nesting the parser follows (it recurses once per
/// level, so this bounds its stack).
pub const MAX_DEPTH: usize = 64;

/// An evaluated expression: its exact value and the literals it used, in
/// order of appearance.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    pub value: Ratio,
    pub literals: Vec<i128>,
}

/// Why an expression earns nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ExprError {
    #[error("empty expression")]
    Empty,
    #[error("longer than {MAX_LEN} bytes")]
    TooLong,
    #[error("parentheses nested deeper than {MAX_DEPTH}")]
    TooDeep,
    #[error("unexpected input at byte {0}")]
    Unexpected(usize),
    #[error("number with a leading zero at byte {0}")]
    LeadingZero(usize),
    #[error("arithmetic overflow")]
    Overflow,
    #[error("division by zero")]
    DivisionByZero,
    #[error("the value after `=` is not the expression's value")]
    WrongClaim,
}

/// Evaluates a completion that may end with `= <number>`, which must then
/// equal the expression's value.
pub fn evaluate_claim(completion: &str) -> Result<Evaluation, ExprError> {
    let text = completion.trim();
    if text.len() > MAX_LEN {
        return Err(ExprError::TooLong);
    }
    let Some((expr, claim)) = text.split_once('=') else {
        return evaluate(text);
    };
    let eval = evaluate(expr)?;
    let claimed = Parser::new(claim.as_bytes()).whole(|p| p.literal())?;
    if claimed == eval.value {
        Ok(eval)
    } else {
        Err(ExprError::WrongClaim)
    }
}

/// Parses and evaluates an expression: `+ - * /`, parentheses, integer
/// literals without leading zeros, ASCII whitespace anywhere between.
pub fn evaluate(expr: &str) -> Result<Evaluation, ExprError> {
    if expr.len() > MAX_LEN {
        return Err(ExprError::TooLong);
    }
    if expr.trim().is_empty() {
        return Err(ExprError::Empty);
    }
    let mut parser = Parser::new(expr.as_bytes());
    let value = parser.whole(|p| p.expr())?;
    Ok(Evaluation {
        value,
        literals: parser.literals,
    })
}

/// A rational number in lowest terms with a positive denominator, so equal
/// values are equal structs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ratio {
    pub num: i128,
    pub den: i128,
}

impl Ratio {
    pub(crate) fn int(n: i128) -> Self {
        Self { num: n, den: 1 }
    }

    pub(crate) fn new(num: i128, den: i128) -> Result<Self, ExprError> {
        if den == 0 {
            return Err(ExprError::DivisionByZero);
        }
        let g = gcd(num, den);
        let (mut num, mut den) = (num / g, den / g);
        if den < 0 {
            num = num.checked_neg().ok_or(ExprError::Overflow)?;
            den = den.checked_neg().ok_or(ExprError::Overflow)?;
        }
        Ok(Self { num, den })
    }
}

/// gcd of |a| and |b|, at least 1 (so dividing by it is always safe).
/// Works on `u128` so `i128::MIN` cannot overflow.
fn gcd(a: i128, b: i128) -> i128 {
    let (mut a, mut b) = (a.unsigned_abs(), b.unsigned_abs());
    while b != 0 {
        (a, b) = (b, a % b);
    }
    // Only gcd(i128::MIN, i128::MIN or 0) = 2^127 does not fit; dividing by
    // 1 instead leaves that value to the overflow check of the sign flip.
    i128::try_from(a.max(1)).unwrap_or(1)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Add,
    Sub,
    Mul,
    Div,
}

impl Op {
    pub(crate) fn apply(self, a: Ratio, b: Ratio) -> Result<Ratio, ExprError> {
        let o = ExprError::Overflow;
        match self {
            Op::Add | Op::Sub => {
                let l = a.num.checked_mul(b.den).ok_or(o)?;
                let r = b.num.checked_mul(a.den).ok_or(o)?;
                let num = if self == Op::Add {
                    l.checked_add(r)
                } else {
                    l.checked_sub(r)
                };
                Ratio::new(num.ok_or(o)?, a.den.checked_mul(b.den).ok_or(o)?)
            }
            Op::Mul => Ratio::new(
                a.num.checked_mul(b.num).ok_or(o)?,
                a.den.checked_mul(b.den).ok_or(o)?,
            ),
            Op::Div => {
                if b.num == 0 {
                    return Err(ExprError::DivisionByZero);
                }
                Ratio::new(
                    a.num.checked_mul(b.den).ok_or(o)?,
                    a.den.checked_mul(b.num).ok_or(o)?,
                )
            }
        }
    }

    pub(crate) fn symbol(self) -> char {
        match self {
            Op::Add => '+',
            Op::Sub => '-',
            Op::Mul => '*',
            Op::Div => '/',
        }
    }

    pub(crate) fn precedence(self) -> u8 {
        match self {
            Op::Add | Op::Sub => 1,
            Op::Mul | Op::Div => 2,
        }
    }
}

/// Recursive descent over bytes (every token is ASCII; any other byte is
/// unexpected input). Recursion happens only through parentheses, which
/// `MAX_DEPTH` bounds.
struct Parser<'a> {
    bytes: &'a [u8],
    pos: usize,
    depth: usize,
    literals: Vec<i128>,
}

impl<'a> Parser<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self {
            bytes,
            pos: 0,
            depth: 0,
            literals: Vec::new(),
        }
    }

    /// Runs `f` and requires it to consume everything but whitespace.
    fn whole(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<Ratio, ExprError>,
    ) -> Result<Ratio, ExprError> {
        let v = f(self)?;
        match self.peek() {
            None => Ok(v),
            Some(_) => Err(ExprError::Unexpected(self.pos)),
        }
    }

    /// The next non-whitespace byte, skipping the whitespace.
    fn peek(&mut self) -> Option<u8> {
        while self
            .bytes
            .get(self.pos)
            .is_some_and(u8::is_ascii_whitespace)
        {
            self.pos += 1;
        }
        self.bytes.get(self.pos).copied()
    }

    /// expr := term (('+' | '-') term)*
    fn expr(&mut self) -> Result<Ratio, ExprError> {
        let mut v = self.term()?;
        loop {
            let op = match self.peek() {
                Some(b'+') => Op::Add,
                Some(b'-') => Op::Sub,
                _ => return Ok(v),
            };
            self.pos += 1;
            v = op.apply(v, self.term()?)?;
        }
    }

    /// term := factor (('*' | '/') factor)*
    fn term(&mut self) -> Result<Ratio, ExprError> {
        let mut v = self.factor()?;
        loop {
            let op = match self.peek() {
                Some(b'*') => Op::Mul,
                Some(b'/') => Op::Div,
                _ => return Ok(v),
            };
            self.pos += 1;
            v = op.apply(v, self.factor()?)?;
        }
    }

    /// factor := literal | '(' expr ')'
    fn factor(&mut self) -> Result<Ratio, ExprError> {
        match self.peek() {
            Some(b'(') => {
                self.depth += 1;
                if self.depth > MAX_DEPTH {
                    return Err(ExprError::TooDeep);
                }
                self.pos += 1;
                let v = self.expr()?;
                if self.peek() != Some(b')') {
                    return Err(ExprError::Unexpected(self.pos));
                }
                self.pos += 1;
                self.depth -= 1;
                Ok(v)
            }
            _ => {
                let v = self.literal()?;
                self.literals.push(v.num);
                Ok(v)
            }
        }
    }

    /// A non-negative integer without leading zeros.
    fn literal(&mut self) -> Result<Ratio, ExprError> {
        let start = match self.peek() {
            Some(b) if b.is_ascii_digit() => self.pos,
            _ => return Err(ExprError::Unexpected(self.pos)),
        };
        let mut n: i128 = 0;
        while let Some(&b) = self.bytes.get(self.pos).filter(|b| b.is_ascii_digit()) {
            n = n
                .checked_mul(10)
                .and_then(|n| n.checked_add(i128::from(b - b'0')))
                .ok_or(ExprError::Overflow)?;
            self.pos += 1;
        }
        if self.bytes[start] == b'0' && self.pos - start > 1 {
            return Err(ExprError::LeadingZero(start));
        }
        Ok(Ratio::int(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(expr: &str) -> Result<Ratio, ExprError> {
        evaluate(expr).map(|e| e.value)
    }

    fn r(num: i128, den: i128) -> Ratio {
        Ratio::new(num, den).unwrap()
    }

    #[test]
    fn parser_follows_precedence_and_exact_rationals() {
        let cases = [
            ("3*5+7", r(22, 1)),
            ("3+5*7", r(38, 1)),
            ("(3+5)*7", r(56, 1)),
            ("10-4-3", r(3, 1)),
            ("10-(4-3)", r(9, 1)),
            ("8/4/2", r(1, 1)),
            ("8/(4/2)", r(4, 1)),
            ("6/4*2", r(3, 1)),
            ("1/3+1/3+1/3", r(1, 1)),
            ("2/3", r(2, 3)),
            ("3-5", r(-2, 1)),
            (" ( 3 +\t5 ) \n* 7 ", r(56, 1)),
            ("((((7))))", r(7, 1)),
            ("0", r(0, 1)),
        ];
        for (expr, want) in cases {
            assert_eq!(value(expr), Ok(want), "{expr:?}");
        }
        assert_eq!(evaluate("3*5+7").unwrap().literals, vec![3, 5, 7]);
    }

    #[test]
    fn parser_rejects_what_it_cannot_account_for() {
        let deep_ok = format!("{}1{}", "(".repeat(MAX_DEPTH), ")".repeat(MAX_DEPTH));
        assert_eq!(value(&deep_ok), Ok(r(1, 1)));
        let too_deep = format!(
            "{}1{}",
            "(".repeat(MAX_DEPTH + 1),
            ")".repeat(MAX_DEPTH + 1)
        );
        assert_eq!(value(&too_deep), Err(ExprError::TooDeep));
        let huge_nest = "(".repeat(10_000);
        assert_eq!(value(&huge_nest), Err(ExprError::TooLong));
        // The depth limit alone stops a deep nest, whatever the length limit.
        let mut p = Parser::new(huge_nest.as_bytes());
        assert_eq!(p.expr(), Err(ExprError::TooDeep));

        let huge = "9".repeat(1000);
        assert_eq!(value(&huge), Err(ExprError::TooLong));
        assert_eq!(value(&"9".repeat(60)), Err(ExprError::Overflow));
        let big = "9".repeat(30);
        assert_eq!(value(&format!("{big}*{big}")), Err(ExprError::Overflow));
        assert_eq!(
            value(&format!("1/{big}-1/{big}1")),
            Err(ExprError::Overflow)
        );

        for (expr, err) in [
            ("", ExprError::Empty),
            ("   ", ExprError::Empty),
            ("1/0", ExprError::DivisionByZero),
            ("0/0", ExprError::DivisionByZero),
            ("5/(3-3)", ExprError::DivisionByZero),
            ("07+1", ExprError::LeadingZero(0)),
            ("3+", ExprError::Unexpected(2)),
            ("3 5", ExprError::Unexpected(2)),
            ("(3+5", ExprError::Unexpected(4)),
            ("3+5)", ExprError::Unexpected(3)),
            ("-3+5", ExprError::Unexpected(0)),
            ("3++5", ExprError::Unexpected(2)),
            ("3×5", ExprError::Unexpected(1)),
            ("3x5", ExprError::Unexpected(1)),
            ("3^5", ExprError::Unexpected(1)),
            ("3.5", ExprError::Unexpected(1)),
            ("日本語", ExprError::Unexpected(0)),
            ("3*5+7 abc", ExprError::Unexpected(6)),
        ] {
            assert_eq!(value(expr), Err(err), "{expr:?}");
        }
    }
}
