"""What the schedule tests share: the stages per rank (V) each built-in schedule is tried
with (the builders accept these; zbv and dualpipev only V=2)."""

from __future__ import annotations

V_CHOICES = {
    "gpipe": (1,),
    "1f1b": (1,),
    "interleaved-1f1b": (1, 2, 3),
    "zb1p": (1, 2, 3),
    "zbv": (2,),
    "dualpipev": (2,),
}
