// The module regex's syntax tree to its program: compile, the fixed width
// of a look-behind, the code of each node (NOTE [Module regexes] in
// src/lora/module_regex.h).

#include "module_regex_internal.h"

namespace colossalai {
namespace lora {
namespace detail {

void Compiler::compile() {
  Flags flags;
  global_flags(flags);
  const int32_t root = alt(0, flags);
  if (at_ < p_.size()) {
    bad("unbalanced parenthesis");
  }
  re_.start_ = emit_node(root);
  emit({ModuleRegex::Op::kMatch});
  // Lookaround programs after the main one, each ending in its own match
  // (all were parsed, nested ones included, before this).
  for (size_t k = 0; k < pending_.size(); ++k) {
    re_.looks_[k].start = static_cast<int32_t>(re_.prog_.size());
    emit_node(pending_[k]);
    emit({ModuleRegex::Op::kMatch});
  }
}

// The number of characters `id` always matches, -1 if that varies.
long Compiler::fixed_width(int32_t id) const {
  const Node& n = nodes_[id];
  switch (n.kind) {
    case Node::kChar:
    case Node::kAny:
    case Node::kClass:
      return 1;
    case Node::kEmpty:
    case Node::kAssert:
      return 0;
    case Node::kConcat: {
      long sum = 0;
      for (const int32_t k : n.kids) {
        const long w = fixed_width(k);
        if (w < 0) {
          return -1;
        }
        sum += w;
      }
      return sum;
    }
    case Node::kAlt: {
      const long w = fixed_width(n.kids[0]);
      for (size_t k = 1; k < n.kids.size(); ++k) {
        if (fixed_width(n.kids[k]) != w) {
          return -1;
        }
      }
      return w;
    }
    case Node::kRepeat: {
      const long w = fixed_width(n.kids[0]);
      return w == 0 ? 0 : (w < 0 || n.min != n.max) ? -1 : w * n.min;
    }
  }
  return -1;
}

int32_t Compiler::emit(ModuleRegex::Inst inst) {
  if (re_.prog_.size() >= ModuleRegex::kMaxProgram) {
    throw std::invalid_argument(
        "compiles to more than " +
        std::to_string(ModuleRegex::kMaxProgram) +
        " steps (repeat counts multiply their group)");
  }
  re_.prog_.push_back(inst);
  return static_cast<int32_t>(re_.prog_.size() - 1);
}

// Emits `id`'s code; returns where it starts.
int32_t Compiler::emit_node(int32_t id) {
  using Op = ModuleRegex::Op;
  const int32_t start = here();
  const Node& n = nodes_[id];
  switch (n.kind) {
    case Node::kEmpty:
      break;
    case Node::kChar: {
      ModuleRegex::Inst i{Op::kChar};
      i.c = n.flag ? lower(n.c) : n.c;
      i.flag = n.flag;
      emit(i);
      break;
    }
    case Node::kAny: {
      ModuleRegex::Inst i{Op::kAny};
      i.flag = n.flag;
      emit(i);
      break;
    }
    case Node::kClass: {
      ModuleRegex::Inst i{Op::kClass};
      i.x = n.index;
      emit(i);
      break;
    }
    case Node::kAssert: {
      ModuleRegex::Inst i{n.index >= 0 ? Op::kLook : Op::kAssert};
      i.assert_kind = n.assert_kind;
      i.x = n.index;
      emit(i);
      break;
    }
    case Node::kConcat:
      for (const int32_t k : n.kids) {
        emit_node(k);
      }
      break;
    case Node::kAlt: {
      // split L1, next; L1: a; jump end; next: split L2, next2; ... last.
      const auto& kids = n.kids;
      std::vector<int32_t> jumps;
      for (size_t k = 0; k + 1 < kids.size(); ++k) {
        const int32_t split = emit({Op::kSplit});
        re_.prog_[split].x = here();
        emit_node(kids[k]);
        jumps.push_back(emit({Op::kJump}));
        re_.prog_[split].y = here();
      }
      emit_node(kids.back());
      for (const int32_t j : jumps) {
        re_.prog_[j].x = here();
      }
      break;
    }
    case Node::kRepeat: {
      const int32_t kid = n.kids[0];
      const int min = n.min, max = n.max;
      for (int k = 0; k < min; ++k) {
        emit_node(kid);
      }
      if (max < 0) {
        const int32_t split = emit({Op::kSplit});
        re_.prog_[split].x = here();
        emit_node(kid);
        ModuleRegex::Inst back{Op::kJump};
        back.x = split;
        emit(back);
        re_.prog_[split].y = here();
      } else {
        std::vector<int32_t> splits;
        for (int k = min; k < max; ++k) {
          const int32_t split = emit({Op::kSplit});
          re_.prog_[split].x = here();
          splits.push_back(split);
          emit_node(kid);
        }
        for (const int32_t s : splits) {
          re_.prog_[s].y = here();
        }
      }
      break;
    }
  }
  return start;
}

} // namespace detail
} // namespace lora
} // namespace colossalai
