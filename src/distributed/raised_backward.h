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

#include <colossalai/distributed/process_group.h>

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

} // namespace detail
} // namespace distributed
} // namespace colossalai
