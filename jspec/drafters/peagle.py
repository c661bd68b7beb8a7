"""PEagle (parallel EAGLE): the EAGLE3 module drafting all K tokens in one forward.

The forward runs over [pairs..., MASK x (K-1)]: each pair is (token t+1, target aux
states at t) as in EAGLE3, the last pair being (bonus token, aux at the last verified
position); the K-1 mask slots carry ``mask_token_id`` and the learned ``mask_hidden``
(fc-projected like real aux states) at the next K-1 positions. Attention is ordinary
causal attention by position, so the mask slots may sit anywhere along the query axis
(``propose.peagle_propose`` appends them after the padded pairs). Draft k (k = 0..K-1)
is read at the last pair (k = 0) and at mask slot k.
"""

from __future__ import annotations

from jspec.drafters.eagle3 import Eagle3Drafter

PEagleDrafter = Eagle3Drafter  # cfg.method == "peagle" adds the mask_hidden parameter
