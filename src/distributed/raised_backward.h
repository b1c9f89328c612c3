#pragma once

// What the ranks agree on after a backward raised (internal).
//
// NOTE [A backward that raised on some ranks]
// A backward that raised stops issuing its collectives where it raised
// (NOTE [A backward that raised] in grad_bucketer.h), and so does a forward
// that gathers parameters or reduces across tensor-parallel ranks (FSDP,
// Gemini, HybridParallel). The process goes on only if every other member
// of its groups stopped at the same point. A rank whose pass went on waits
// for collectives the raised one never issues, and a raised rank that went
// on to its next pass would pair those with its next ones: wrong gradients
// or weights without an error. So before a raised pass's leftovers are
// dropped, the ranks agree out of band, through the rendezvous store (the
// groups' collectives may be stuck): on each group of this process, each
// rank counts itself in and files how many collectives it had issued on
// the group (Issue in collective_ops.h). Recovery goes on once every member
// has come with the same count, so that what is still in flight pairs up.
// A member that does not come within the group's timeout, or a different
// count, is a DistributedError naming the cause, and the group refuses
// every later operation with it: the run cannot go on, only restart from a
// checkpoint. The members that did not raise fail within their own
// collective timeout, as with a rank that died. A pass that raised before
// issuing any collective needs no agreement: the others wait for its
// collectives as for a slow rank, and its next pass issues them.
//
// Before it agrees, a raised rank files what raised in the world group's
// keys, one generation per agreement the world made (the same count on
// every rank). A member that did not raise fails from its own collective
// timeout; its error then reads that filing and names the raised rank's
// cause rather than only a timeout. A raised rank that hosts the store
// would take the filing with it on exit, so before it fails for ranks that
// did not come it waits, at most another group timeout, until that many
// ranks have read it (a dead rank costs it two timeouts). A pipeline step
// that raised after its stages had exchanged anything cannot agree at all
// (sends and receives pair by peer, not by count): it breaks every group
// of the process, files its cause and waits for the others to read, then
// fails. These store calls run on a thread of their own with a deadline
// (three group timeouts and 5 s for an agreement, 5 s for reading another
// rank's filing): a store whose host hung, or across a dropped link, blocks
// a call for as long as its socket waits.
//
// NOTE [A step that raised]
// An optimizer step that raised on some ranks only leaves the ranks apart
// even where it communicated nothing: DDP's replicas no longer hold the same
// weights, a sharded optimizer stepped some shards and not others, and a
// ZeRO rank that raised before its all-gather pairs its next backward's
// reduce-scatters with the others' all-gathers. So after any step that
// raised, the ranks agree as after a pass, whether it communicated or not:
// where every rank raised after the same collectives, what the step left is
// the same on every rank and the loop may go on (a step whose optimizer
// raised before it updated anything is then the same as one skipped);
// otherwise every rank fails.

#include <colossalai/distributed/process_group.h>

#include <functional>
#include <string>

namespace colossalai {
namespace distributed {
namespace detail {

/// Agrees with every member of every group of this process (more than one
/// member) that a `pass` ("forward", "backward") raised here after the same
/// collectives, waiting at most each group's timeout; throws
/// DistributedError, with `cause` (the pass's error) in its message, and
/// breaks the group otherwise.
void agree_after_raise(const std::string& pass, const std::string& cause);

/// Collectives this process issued so far, on every group: a pass that
/// raised before issuing any left nothing for the others to pair up with
/// (they wait for its collectives as for a slow rank), and needs no
/// agreement.
uint64_t collectives_issued();

/// Refuses, from now on, every operation on `group` with `reason`.
void break_group(const ProcessGroup& group, const std::string& reason);

/// Runs an optimizer wrapper's `step`. Where the outermost step of this
/// thread raised anything but a DistributedError, the ranks agree as after
/// a pass (NOTE [A step that raised]) before it propagates.
void guard_step(const std::function<void()>& step);

/// Collectives, sends and receives this process issued so far: a pipeline
/// step that issued none before it raised left no peer waiting on it.
uint64_t operations_issued();

/// After a pipeline step raised here, having exchanged activations or
/// gradients: files `cause`, breaks every group of this process, waits (at
/// most twice the world's timeout) for the other ranks to read the cause,
/// and throws the DistributedError that names it.
[[noreturn]] void fail_after_raised_pipeline(const std::string& cause);

/// What another rank filed after a pass of its raised, for the error of an
/// operation of `group` that failed here (it waited for that rank), or ""
/// where nothing was filed or the store does not answer within a few
/// seconds. Breaks `group` with it.
std::string raised_elsewhere(const ProcessGroup& group);

} // namespace detail
} // namespace distributed
} // namespace colossalai
