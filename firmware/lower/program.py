"""The program the passes hand on: the kernel, its block-level skeleton, its phases and
what each pass decided about them. The passes (firmware/lower/passes/) fill it in order;
the renderer (render.py) only reads it.

Results about syntax-tree nodes live in the analysis objects, keyed by the kernel's
nodes (see syntax.Origins for copies), never as attributes of the nodes."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from firmware.kernel_check import Kernel
from firmware.lower.abi import Options
from firmware.lower.syntax import Origins

if TYPE_CHECKING:
    from firmware.lower.analysis.affine import AffineAnalysis
    from firmware.lower.analysis.kinds import Kinds


# -- the block-level skeleton: what _grid runs per block, around the phases ---------------
@dataclass
class RunPhase:
    """The loop(s) over the block's threads running phase ``phase``."""

    phase: int


@dataclass
class RunCollective:
    """A block-collective statement's phase (mma), run once per block as thread 0."""

    phase: int


@dataclass
class BlockIf:
    """A uniform ``if`` holding a barrier; ``uniform``: the block-level loop variables
    known where it stands (its test reads the others' thread 0 values)."""

    test: ast.expr
    uniform: tuple[str, ...]
    body: list["BlockNode"]
    orelse: list["BlockNode"] | None  # None: no ``else``


@dataclass
class BlockFor:
    """A uniform ``for`` holding a barrier (its variable is among ``uniform``)."""

    loop: ast.For
    uniform: tuple[str, ...]
    body: list["BlockNode"]


@dataclass
class BlockWhile:
    """A uniform ``while`` holding a barrier."""

    test: ast.expr
    uniform: tuple[str, ...]
    body: list["BlockNode"]


@dataclass
class BlockJump:
    """A ``break`` or ``continue`` of a block-level loop."""

    keyword: str


@dataclass
class BlockBarrier:
    """A ``barrier()`` between two phases: nothing to run (the phases' thread loops are
    the barrier), except that a checked variant starts a new hazard phase there
    (firmware/hazards.py)."""


BlockNode = Union[RunPhase, RunCollective, BlockIf, BlockFor, BlockWhile, BlockJump,
                  BlockBarrier]


# -- vectorised phases ---------------------------------------------------------------------
@dataclass
class Segment:
    """A vectorised phase's statements run as one thread loop, inside the interchanged
    loops ``loop_vars``; ``remat``: the affine locals it recomputes per thread."""

    stmts: list[ast.stmt]
    loop_vars: tuple[str, ...]
    remat: list[str] = field(default_factory=list)


@dataclass
class VLoop:
    """An interchanged uniform loop of a vectorised phase, around its body's items;
    ``jam``: its unroll-and-jam segment, when it has one (passes/vectorise.py)."""

    loop: ast.For
    items: list["Segment | VLoop"]
    jam: Segment | None = None


def segments(items: list["Segment | VLoop"]) -> list[Segment]:
    return [s for it in items
            for s in ([it] if isinstance(it, Segment) else segments(it.items))]


# -- phases --------------------------------------------------------------------------------
@dataclass
class Phase:
    """The statements between two barriers that one thread runs."""

    index: int
    stmts: list[ast.stmt]
    in_loop: bool  # inside a block-level loop: its locals live from one pass to the next
    top: bool  # at the top level of the kernel's body
    #: the block-level loop variables known where it runs (the order the skeleton met them)
    uniform: tuple[str, ...]
    collective: bool = False  # an mma statement (RunCollective)
    #: passes/affine.py and passes/if_convert.py: block-level conditions under which every
    #: affine access is in range and every hoisted guard holds (the range-checked variant)
    range_conds: list[str] = field(default_factory=list)
    vector: list[Segment | VLoop] | None = None  # passes/vectorise.py
    inline: bool = False  # passes/variants.py: written into the block's thread loops
    fast: bool = False  # passes/variants.py: has a range-checked per-thread variant _phf


@dataclass
class Program:
    """One kernel being lowered, and every pass's result."""

    kernel: Kernel
    options: Options
    #: loads and stores of each name anywhere in the kernel (assigned-once tests)
    loads: dict[str, int]
    stores: dict[str, int]
    returns: bool  # the kernel has a ``return``: threads that returned are skipped
    managed: list[str]  # managed buffer parameters (their accesses mark pages)
    skeleton: list[BlockNode] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    uniform_vars: list[str] = field(default_factory=list)  # every block-level loop variable
    kinds: "Kinds | None" = None
    affine: "AffineAnalysis | None" = None
    #: passes/if_convert.py: ``if``s written as a select in range-checked code, and phase
    #: top-level guards that hold for a block whose range checks passed (dropped there)
    selects: set[ast.If] = field(default_factory=set)
    always: set[ast.If] = field(default_factory=set)
    vector_locals: set[str] = field(default_factory=set)  # kept per thread by _phv phases
    per_thread: dict[str, str] = field(default_factory=dict)  # local -> 'int' | 'float'
    #: the syntax-tree copies passes and the renderer make (unroll-and-jam, rewriting),
    #: so analyses keyed on the kernel's nodes answer for them too
    origins: Origins = field(default_factory=Origins)

    @property
    def checked(self) -> bool:
        return self.options.boundscheck

    @classmethod
    def of(cls, k: Kernel, options: Options) -> "Program":
        loads: dict[str, int] = {}
        stores: dict[str, int] = {}
        for n in ast.walk(k.fn):
            if isinstance(n, ast.Name):
                count = stores if isinstance(n.ctx, ast.Store) else loads
                count[n.id] = count.get(n.id, 0) + 1
        return cls(k, options, loads, stores,
                   returns=any(isinstance(n, ast.Return) for n in ast.walk(k.fn)),
                   managed=[p for p, t in zip(k.params, k.arg_types) if t.managed])
