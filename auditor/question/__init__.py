"""What an audit is asked: the head (weight, bias, final norm, token strings; a factorised head as its inner
factor) and the set of hidden states its tokens are argmaxed over."""

from auditor.question.domain import Ball, Box, Domain, Norm, Unbounded, parse_domain
from auditor.question.factorised import is_factor_pair, split_factors
from auditor.question.head import Head
from auditor.question.norm import FinalNorm

__all__ = ["Ball", "Box", "Domain", "FinalNorm", "Head", "Norm", "Unbounded", "is_factor_pair", "parse_domain",
           "split_factors"]
