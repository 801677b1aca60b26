"""The arithmetic that the tests' tolerances derive from: the float formats' unit roundoffs, Higham's
gamma_n, the probabilistic bound's lambda, the exponentials' errors, and a running error analysis
(``Rounded``). Nothing here is measured on the CPU at hand."""
import torch

U32 = 2.0 ** -24  # float32's unit roundoff
U_BF16 = 2.0 ** -8  # bfloat16's unit roundoff: round to nearest even keeps 8 significant bits
LAMBDA = 7.0  # how many standard deviations a probabilistic bound allows (tests/kernels/reference.py: log_softmax_tolerance)
# exp_nonpositive's (kernels/vexp.h) relative error before the rounding of its argument: its polynomial's
# minimax error, 2.0e-9 (2.1e-9 with the float32 coefficients), plus gamma_6 = 6u / (1 - 6u) for its six
# FMAs (Horner over positive terms: each rounds a partial value below the result)
EXP_REL_ERR = 2.1e-9 + 6 * U32 / (1 - 6 * U32)


def gamma(n, u=U32):
    """Higham's gamma_n = n u / (1 - n u): the relative error of n roundings in a row, and of a sum of
    n + 1 terms (or an n-term dot product with or without FMA) in any order, relative to the sum of
    the terms' absolute values (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §3.1)."""
    n = torch.as_tensor(n, dtype=torch.float64).clamp(min=0)
    return n * u / (1 - n * u)


def rounded_to(dtype, bound, exact):
    """``bound`` on a float32 result's error, plus its rounding to ``dtype`` at the end: round to
    nearest even moves x by at most u |x| (bfloat16's u = 2^-8; nothing for float32)."""
    return bound if dtype == torch.float32 else bound + U_BF16 * (exact.abs() + bound)


def within(got, want, bound):
    """|got - want| <= bound elementwise (want and bound float64), with the worst entry in the message."""
    err = (got.detach().double() - want).abs()
    ok = err <= bound
    assert bool(ok.all()), (f"{int((~ok).sum())} of {ok.numel()} entries past the bound; the worst is "
                            f"{float(err[~ok].max())} against {float(bound.expand_as(err)[~ok][(err[~ok]).argmax()])}")


def softmax_sum_bound(n, u=U32, decimals=None):
    """How far the sum of a float32 softmax's n weights, summed again in float32 (any order), may be
    from 1: each weight ẽ_j / l̃ (a division, or a reciprocal and a product: 2 roundings) with l̃ = Σ ẽ
    (n - 1 roundings), whatever the exponentials' own errors (they cancel in the ratio), so Σ p̃
    within (γ_{n-1} + γ_2) / (1 - γ_{n-1}) of 1; the sum again, γ_{n-1} of it; and each weight
    written with ``decimals`` decimals, half a unit of the last."""
    n = torch.as_tensor(n, dtype=torch.float64)
    weights = (gamma(n - 1, u) + gamma(2, u)) / (1 - gamma(n - 1, u))
    written = 0.0 if decimals is None else n * 0.5 * 10.0 ** -decimals
    return weights + gamma(n - 1, u) * (1 + weights + written) + written


def log_softmax_exp_sum_bound(V, m_abs, exp_rel=EXP_REL_ERR, u=U32):
    """How far Σ_j exp(lp_j) may be from 1 for float32 log-probabilities lp = log_softmax(z) over V
    logits whose largest is m (|m| <= m_abs), exponentiated and summed in float32. Each lp_j is off by
    δ_j: x_j = z_j - m (u |x_j|), l = Σ exp(x) (exp_rel and γ_{V-1} relative, so as much absolute in
    log l), log l (2 u |log l|), lse = m + log l (u (|m| + |log l|)), z_j - lse (u |lp_j|): either
    order. Σ p_j |δ_j| then needs Σ p |x| = log l + H and Σ p |lp| = H, with H <= log V and
    0 <= log l <= log V: γ_{V-1} + exp_rel + u (6 log V + |m|); 1.01 for e^δ - 1 against δ; then the
    exponentials (2 u) and their sum (γ_{V-1})."""
    V = torch.as_tensor(V, dtype=torch.float64)
    lp = gamma(V - 1, u) + exp_rel + u * (6 * torch.log(V) + m_abs)
    return 1.01 * lp + (2 * u + gamma(V - 1, u)) * (1 + 1.01 * lp)


# PyTorch's float32 exp and log on the CPU: SLEEF's expf_u10 and logf_u10 (ATen's Vectorized<float>::exp
# and ::log, 1.0 ulp) or libm's (below 1 ulp); 1 ulp is at most 2 u of the result
PT_EXP_REL_ERR = PT_LOG_REL_ERR = 2 * U32


class Rounded:
    """A float32 computation (float32 arithmetic, or float32 sums of a bfloat16 product) carried as its
    exact value ``v`` (float64) and a bound ``e`` on its error, through the operations the code under
    test performs, each adding its own: a running error analysis (Higham, Accuracy and Stability of
    Numerical Algorithms, §3.3), rigorous for any order of the sums (gamma_n) and free of first-order
    approximations; the float64 values' own rounding, 2^-53 relative, is covered by a factor 1.01 where
    the bounds are used."""

    def __init__(self, v, e=None):
        self.v = v.double()
        self.e = torch.zeros_like(self.v) if e is None else e

    @classmethod
    def const(cls, c: float) -> "Rounded":
        """A Python float as float32 arithmetic takes it: rounded to float32 (exact if it is one)."""
        rounded = torch.tensor(c, dtype=torch.float32).item()
        return cls(torch.tensor(c, dtype=torch.float64), torch.tensor(abs(rounded - c), dtype=torch.float64))

    @staticmethod
    def _of(x) -> "Rounded":  # a tensor is taken as exact (the caller's float32 or bfloat16 data)
        return x if isinstance(x, Rounded) else Rounded(x) if isinstance(x, torch.Tensor) else Rounded.const(float(x))

    def __add__(self, other):  # |fl(a^ + b^) - (a + b)| <= ea + eb + u |a^ + b^|
        o = Rounded._of(other)
        v = self.v + o.v
        return Rounded(v, self.e + o.e + U32 * (v.abs() + self.e + o.e))

    def __neg__(self):
        return Rounded(-self.v, self.e)

    def __sub__(self, other):
        return self + -Rounded._of(other)

    def __radd__(self, other):
        return Rounded._of(other) + self

    def __rsub__(self, other):
        return Rounded._of(other) + -self

    def __mul__(self, other):  # |a^ b^ - a b| <= |a| eb + ea |b| + ea eb, then one rounding
        o = Rounded._of(other)
        v = self.v * o.v
        e = self.v.abs() * o.e + self.e * o.v.abs() + self.e * o.e
        return Rounded(v, e + U32 * (v.abs() + e))

    def exp(self, rel=PT_EXP_REL_ERR):  # exp(x + d)(1 + r) - exp(x) <= exp(x) (expm1(|d|) + r exp(|d|))
        v = torch.exp(self.v)
        return Rounded(v, v * (torch.expm1(self.e) + rel * torch.exp(self.e)))

    def log(self, rel=PT_LOG_REL_ERR, abs_err=0.0):  # |log(s + d) - log s| <= -log(1 - |d| / s), then the result's r
        assert bool((self.e < self.v).all())  # (and an absolute error, where a log's is stated so)
        v = torch.log(self.v)
        e = -torch.log1p(-self.e / self.v)
        return Rounded(v, e + rel * (v.abs() + e) + abs_err)

    def sum(self, dim=-1):  # n terms in any order: gamma_{n-1} sum |x^| beside the terms' own errors
        n = self.v.size(dim)
        return Rounded(self.v.sum(dim, keepdim=True),
                       self.e.sum(dim, keepdim=True) + gamma(n - 1) * (self.v.abs() + self.e).sum(dim, keepdim=True))

    def max(self, dim=-1):  # the computed maximum is a computed entry: within the entries' largest error
        return Rounded(self.v.max(dim, keepdim=True).values, self.e.max(dim, keepdim=True).values)

    def log_softmax(self, dim=-1, exp_rel=PT_EXP_REL_ERR, log_rel=PT_LOG_REL_ERR):  # ATen's order: (x - max) - log(sum exp(x - max))
        x = self - self.max(dim)
        return x - x.exp(exp_rel).sum(dim).log(log_rel)

    def logsumexp(self, dim=-1, exp_rel=PT_EXP_REL_ERR, log_rel=PT_LOG_REL_ERR, log_abs=0.0):  # max + log(sum exp(x - max))
        m = self.max(dim)
        return m + (self - m).exp(exp_rel).sum(dim).log(log_rel, log_abs)

    def gather(self, index):  # entries picked from each row: exactly those values
        return Rounded(self.v.gather(-1, index), self.e.gather(-1, index))

    def __matmul__(self, other):  # n products (exact for bfloat16 factors) summed in float32: gamma_n
        a, b, n = self, other, self.v.size(-1)
        v = a.v @ b.v
        e = a.v.abs() @ b.e + a.e @ b.v.abs() + a.e @ b.e
        return Rounded(v, e + gamma(n) * ((a.v.abs() + a.e) @ (b.v.abs() + b.e)))

    def addmm(self, a, b):  # self + a @ b by a BLAS call: n + 1 terms per entry, summed in any order
        n = a.v.size(-1)
        v = self.v + a.v @ b.v
        e = self.e + a.v.abs() @ b.e + a.e @ b.v.abs() + a.e @ b.e
        return Rounded(v, e + gamma(n + 1) * (self.v.abs() + self.e + (a.v.abs() + a.e) @ (b.v.abs() + b.e)))

    def __getitem__(self, index):
        return Rounded(self.v[index], self.e[index])

    @property
    def T(self):
        return Rounded(self.v.transpose(-2, -1), self.e.transpose(-2, -1))

    def at(self, mask) -> "Rounded":
        """This value where ``mask`` is True, an exact 0 elsewhere (indexing, scattering: no rounding)."""
        zero = torch.zeros((), dtype=torch.float64)
        return Rounded(torch.where(mask, self.v, zero), torch.where(mask, self.e, zero))

    def to(self, dtype) -> "Rounded":  # round to nearest even: at most u |x^| more (bfloat16's u = 2^-8)
        if dtype == torch.float32:
            return self
        return Rounded(self.v, self.e + U_BF16 * (self.v.abs() + self.e))


def loss_sums(z, target, eps_ls, pad_id, exp_rel=PT_EXP_REL_ERR, log_rel=PT_LOG_REL_ERR,
              ref_exp_rel=PT_EXP_REL_ERR, ref_log_rel=PT_LOG_REL_ERR):
    """The summed loss and NLL of z (N,V) (float32, or bfloat16 widened: exact) as the two paths compute
    them in float32, as ``Rounded`` values (the same exact value; two bounds): ``_SmoothedCrossEntropy``'s
    forward, log Z = logsumexp(z) (``exp_rel``, ``log_rel``: the C kernel's own exp and log, or CUDA's),
    s = sum_v z_v, then ``smoothed_row_losses``; and ``label_smoothed_loss_reference``'s, log p =
    log_softmax(z) (``ref_exp_rel``, ``ref_log_rel``), nll = -log p_g, others = sum_v log p_v - log p_g
    - log p_pad, (1 - eps) nll - eps' others. Padding rows are an exact 0 in both (masked, not rounded); the python
    constants are rounded to float32 (``Rounded.const``). Returns ((loss, nll) fused, (loss, nll) reference)."""
    N, V = z.shape
    zf, g, keep = Rounded(z), target[:, None], (target != pad_id)[:, None]
    eps_o = eps_ls / (V - 2)
    log_z, zg, zp = zf.logsumexp(exp_rel=exp_rel, log_rel=log_rel), zf.gather(g), zf[:, pad_id:pad_id + 1]
    f_nll = log_z - zg
    f_loss = log_z - Rounded.const(1.0 - eps_ls) * zg - Rounded.const(eps_o) * (zf.sum() - zg - zp)
    lp = zf.log_softmax(exp_rel=ref_exp_rel, log_rel=ref_log_rel)
    gold = lp.gather(g)
    r_nll = -gold
    r_loss = Rounded.const(1.0 - eps_ls) * r_nll - Rounded.const(eps_o) * (lp.sum() - gold - lp[:, pad_id:pad_id + 1]) \
        if eps_ls > 0 else r_nll
    return tuple(tuple(x.at(keep).sum(0) for x in pair) for pair in ((f_loss, f_nll), (r_loss, r_nll)))


def smoothed_loss_gradients(z, target, eps_ls, pad_id, g_loss=1.0, g_nll=0.0, exp_rel=PT_EXP_REL_ERR,
                            log_rel=PT_LOG_REL_ERR, ref_exp_rel=PT_EXP_REL_ERR, ref_log_rel=PT_LOG_REL_ERR):
    """d (g_loss loss + g_nll nll) / d z as the two paths compute it in float32 from z (N,V), each
    rounded to z's dtype at the end, as ``Rounded`` values (the same exact value; two bounds):
    ``_SmoothedCrossEntropy``'s PyTorch backward, exp(z - log Z) a - c, + c at pad, - e at gold (a =
    g_loss + g_nll, c = g_loss eps', e = g_loss (1 - eps - eps') + g_nll, in float32; ``exp_rel``,
    ``log_rel``: its exp and log, the forward's log Z's too), and ``label_smoothed_loss_reference``'s
    autograd: d log p = -g_loss eps' everywhere, + g_loss eps' at pad, + g_loss (eps' - (1 - eps)) -
    g_nll at gold, then log_softmax's backward d log p - exp(log p) sum_v d log p (``ref_exp_rel``,
    ``ref_log_rel``)."""
    N, V = z.shape
    eps_o = eps_ls / (V - 2)
    zf = Rounded(z)  # bfloat16 widened to float32: exact
    keep = (target != pad_id)[:, None]
    pad = (torch.arange(V) == pad_id)[None] & keep
    gold = torch.nn.functional.one_hot(target, V).bool() & keep
    full = torch.ones(N, V)
    gl, gn = Rounded.const(g_loss), Rounded.const(g_nll)
    a = (gl + gn) * full
    c = gl * Rounded.const(eps_o) * full
    e = (gl * Rounded.const(1.0 - eps_ls - eps_o) + gn) * full
    p = (zf - zf.logsumexp(exp_rel=exp_rel, log_rel=log_rel)).exp(exp_rel)
    fused = p * a - c + c.at(pad) - e.at(gold)
    d_others, d_gold = gl * Rounded.const(-eps_o) * full, gl * Rounded.const(1.0 - eps_ls) * full
    dlp = d_others + (-d_others).at(pad) + (-d_others - d_gold - gn * full).at(gold)
    lp = zf.log_softmax(exp_rel=ref_exp_rel, log_rel=ref_log_rel)
    ref = dlp - lp.exp(ref_exp_rel) * dlp.sum()
    return fused.at(keep).to(z.dtype), ref.at(keep).to(z.dtype)
