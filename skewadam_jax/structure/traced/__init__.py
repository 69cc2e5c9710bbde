"""Structure from the computation: tiers and batch axes read from the traced program.

Names are only the fast path (`moe_param_labels`, `moe_batch_axes`); what makes a
parameter a router, an expert bank or a stack of scanned layers is what the model does
with it. `trace_structure` traces the forward (or loss) function to a jaxpr (nothing runs
on data) and follows every parameter through it:

* a **routing decision** is a `top_k`, `approx_max_k`, `argmax`/`argmin` or a `sort`
  (argsort) whose operand has an expert axis: one a parameter's axis reaches and no
  input's axis does. Token choice selects along it (the indices are expert ids); expert
  choice selects along the token axis and the expert axis is another (the indices are
  token positions). The parameters whose axes reach the expert axis (the kernel whose
  contraction produces it, any bias or scale added to the logits) are the **router**,
  and its length is the expert count `E`; so is a parameter that the logits depend on
  and that reaches the outputs only through them (a scale of the router's input). A
  selection within the groups of a split expert axis (group-limited routing: `[T, E] ->
  [T, G, E/G]`, top groups kept, reshaped back) is no decision of its own;
* an **expert bank** is a parameter whose axis of length `E` meets an expert-indexed
  axis: a `dot_general` batch dimension shared with tokens dispatched by the decision
  (gathered, scattered or sorted by routing indices; tokens an expert choice gathers
  keep its expert axis), a batch or contracting dimension (or an elementwise
  alignment) shared with an axis that indexes experts (the router's logits, a one-hot
  of the expert ids, the axis a scatter writes at expert ids: `zeros([T, E]).at[
  arange(T)[:, None], ids].set(w)`), the group axis of a `ragged_dot`, an axis
  gathered (or dynamically sliced) by expert ids (a decision's indices, or an E-long
  iota read at positions computed from them: `jnp.repeat(arange(E), sizes)`), or an
  E-long axis of an operand of a call the analysis cannot enter (a Pallas grouped
  matmul) whose integer operands derive from the decision; that axis is a batch axis;
* a **unit stored apart** is a parameter whose every way to the outputs goes through a
  mask of a decision's expert ids against a constant (`where(ids == 2, y, 0)`, a
  product with `ids == 2` or with column 2 of a one-hot of the ids): experts, one matrix
  (a Python list of expert matrices); a stacked parameter applied unit by unit under
  such masks is a bank along the axis taken apart. A parameter whose outputs, stacked
  with the other units' (`stack([unit(x) for unit in modules], 1)`), sit at position
  `p` of an axis that meets an axis indexing E experts (contracted with a one-hot of the
  ids, read at the ids) is unit `p` too (`units`);
* **scanned layers** are parameters consumed (whatever the transposes, reshapes,
  broadcasts and slices on the way) as the `xs` of a `scan` that reads no input data;
  the scanned axis, mapped back to the parameter's own axis, is a batch axis, one per
  nesting level. Layers applied by a `vmap` (lowered in the jaxpr) show as logits with
  a parameter axis besides the expert axis (`[L, T, E]`, or expert-choice scores whose
  layer axis is a batch dimension of the contraction making them): one decision per
  slice, and that axis is a batch axis of every parameter axis aligned with it;
* **stacked matrices**: a parameter axis whose every element is taken out as a single
  piece and dropped (`unstack`, width-1 `split`s or slices then `squeeze`, a
  `dynamic_slice` at a loop counter) is a batch axis; an axis merged by a reshape is
  remembered and given back when a later reshape splits the same sizes apart, and the
  parts of a split axis when merged again in order; values computed from piece `i` of
  an axis, stacked (or concatenated) at position `i`, carry that axis again
  (`stack([x @ w[e] for e in range(E)])`);
* everything else (dense paths, shared experts, a decision that dispatches nothing)
  is backbone, with no batch axes: its other axes form one matrix.

Every variable of the jaxpr carries, per axis, the set of parameter axes it derives from
and whether an input's axis reaches it (through `transpose`, `reshape` where the axis
survives as its own dimension, `broadcast_in_dim`, slicing, elementwise ops,
`dot_general` free and batch dimensions, `gather` offset dimensions, reductions over the
other axes), plus whether it depends on the inputs, on which routing decisions, whether
its values are expert ids or are zero unless the ids equal a constant (a mask), and
which leaves its values depend on (all of them, those not only through a router's
logits, those not only through a mask). Calls are entered (`jit`, `remat`,
`custom_jvp`/`custom_vjp`, `shard_map`; a hijax primitive, `call_hi_primitive`, through
its expansion), `scan`/`while` carries are iterated to a fixed point and `cond` branches
are joined; a `triangular_solve` is read as a contraction with the inverse and the
factorisations keep their batch axes; random keys (typed or legacy) carry no parameter
information. The analysis runs up to three times: the first
pass finds the decisions and their routers, the second marks the logits' axes as
expert-indexed, the third (when a decision dispatches a bank) stops the value
dependences at the logits. A parameter that reaches a primitive with no rule is
reported as undecided, with a warning naming the primitive and the user's line; so is one
feeding a selection among parameter values that makes no decision, one the function
never reads, one producing or meeting the tokens of a decision whose expert axis cannot
be told (several operand axes come from parameters, none from the inputs), one of
the units joined along an axis whose positions may have moved, one whose
E-long axis meets values routed by a decision that dispatches nothing the analysis can
see (its expert axis lost), and one masked by several ids with no unit axis. Undecided
leaves come with a `TraceWarning` (an `sj.UnsureLabelWarning`).

Each leaf also gets a **role**, read from what the program does with the parameter's own
values, with the user's line of the equation that shows it: a router (its bias if a
vector), an expert bank (a per-expert vector), an embedding (rows gathered by token ids
or positions), the output layer (contracted with activations, nothing contracted after
it before the outputs), a hidden matrix (otherwise contracted with activations, a matrix
beside its batch axes) or a bias/gain (added to or multiplying activations). A policy
with a `'hidden'` tier (`sj.MUON_TIERS`) gives it to the hidden matrices:
`Structure.labels_for(tiers)`, or `sj.skewadam(lr, tiers=sj.MUON_TIERS,
param_labels=structure)`.

The package: `info` (what the analysis knows about one variable, its typed tokens),
`analysis` (the interpreter over a jaxpr and what it records), `findings` (what a rule
finds, applied by the interpreter), `primitives` (jax's primitive objects, the table's
keys), `rules` (the rule table and its property tables, one rule per primitive, by
family), `masks` (expert-id masks), `units` (units joined along an axis), `decide`
(findings to tiers) and `api` (`trace_structure`).
"""

from skewadam_jax.structure.traced.api import TraceWarning
from skewadam_jax.structure.traced.api import trace_structure
from skewadam_jax.structure.traced.results import LeafStructure
from skewadam_jax.structure.traced.results import RoutingDecision
from skewadam_jax.structure.traced.results import Structure

__all__ = ['LeafStructure', 'RoutingDecision', 'Structure', 'TraceWarning', 'trace_structure']
