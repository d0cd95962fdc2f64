"""The one restricted unpickler: every pickle bnaudit reads is interpreted here, and only here.

`unpickle(data, mode, storages, start)` runs the pickle opcodes of `data` from `start` to
their STOP on this module's own machine, every opcode of protocols 0 to 5 but the
extension registry and out-of-band buffers (neither of pickle's Unpicklers, C or Python,
ever sees a file's bytes), and returns `Unpickled(value, end, stand_ins)`. No global a file
names is imported or called: what each becomes, in each `Mode`, is formats/allowed.py's
policy. Every failure is `Refused` with one line; nothing else escapes.

Bounds, checked before anything is allocated: a length an opcode claims must lie in `data`;
every opcode spends the pickle's object budget (`allowed.MAX_OBJECTS`) except a memo read,
so that memory stays within ~100 bytes per object however large the pickle; dict keys and
set elements are checked by the policy before they are hashed.
"""

from __future__ import annotations

import ast
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bnaudit.errors import BnauditError
from bnaudit.formats.allowed import (
    DICTS,
    MAX_OBJECTS,
    Mode,
    Policy,
    Refused,
    Storages,
    dict_key,
    set_elements,
)
from bnaudit.formats.pickled import StandIn, StandInObject


@dataclass
class Unpickled:
    value: Any
    end: int  # the offset after the STOP opcode
    stand_ins: dict[str, StandIn] = field(default_factory=dict)  # in the order named


def unpickle(data: Any, mode: Mode, storages: Storages | None = None, start: int = 0) -> Unpickled:
    """Interpret the pickle at `data[start:]` (bytes, or an mmap of a file) in `mode`; raises
    `Refused` (or a subclass) with one line, never anything else."""
    machine = _Machine(data, Policy(mode, storages or Storages()), start)
    try:
        value = machine.run()
    except (Refused, BnauditError):  # a reader's own refusal (a storage's) passes as it is
        raise
    except RecursionError:
        raise Refused("nested too deeply") from None
    except MemoryError:
        raise Refused("too large to unpickle") from None
    except Exception as exc:  # malformed bytes: an opcode on an empty stack, a missing memo entry, ...
        raise Refused(f"malformed pickle at byte {machine.pos} ({type(exc).__name__})") from None
    return Unpickled(value, machine.pos, machine.policy.stand_ins)


_OP = {name: getattr(pickle, name)[0] for name in pickle.__all__ if isinstance(getattr(pickle, name), bytes)}
_BINPUT, _BINGET, _BINUNICODE, _BININT1, _MARK, _TUPLE, _TUPLE1, _LONG_BINPUT, _STOP = (
    _OP[name]
    for name in ("BINPUT", "BINGET", "BINUNICODE", "BININT1", "MARK", "TUPLE", "TUPLE1", "LONG_BINPUT", "STOP")
)
_UINT4, _INT4, _UINT2, _UINT8, _DOUBLE = (struct.Struct(f).unpack_from for f in ("<I", "<i", "<H", "<Q", ">d"))


class _Machine:
    def __init__(self, data: Any, policy: Policy, start: int) -> None:
        self.data, self.policy, self.pos = data, policy, start
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []
        self.memo: dict[int, Any] = {}

    # -- reading the bytes

    def take(self, n: int) -> Any:
        start = self.pos
        if n < 0 or start + n > len(self.data):
            raise Refused(f"a record claims {n} bytes, only {len(self.data) - start} remain")
        self.pos = start + n
        return self.data[start : start + n]

    def line(self) -> bytes:
        end = self.data.find(b"\n", self.pos)
        if end < 0:
            raise Refused("a text opcode without its end of line")
        text = bytes(self.data[self.pos : end])
        self.pos = end + 1
        return text

    def pop_mark(self) -> list[Any]:
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    # -- the loop

    def run(self) -> Any:
        data, policy, handlers, memo = self.data, self.policy, _HANDLERS, self.memo
        end = len(data)
        pos, stack = self.pos, self.stack
        # The opcodes of every tensor record are decoded here, with the position and the stack
        # in locals (a torch.save pickle is mostly these); the rest by their handlers, which
        # see and leave both on `self`.
        while True:
            op = data[pos]
            policy.budget -= 1
            if policy.budget < 0:
                raise Refused(f"builds more than {MAX_OBJECTS} objects")
            if op == _BINPUT and pos + 1 < end:
                memo[data[pos + 1]] = stack[-1]
                pos += 2
            elif op == _BINGET and pos + 1 < end:
                stack.append(memo[data[pos + 1]])
                policy.budget += 1  # a reference, not a new object
                pos += 2
            elif op == _BINUNICODE and pos + 5 <= end:
                size = _UINT4(data, pos + 1)[0]
                if pos + 5 + size > end:
                    raise Refused(f"a record claims {size} bytes, only {end - pos - 5} remain")
                stack.append(str(data[pos + 5 : pos + 5 + size], "utf-8", "surrogatepass"))
                pos += 5 + size
            elif op == _BININT1 and pos + 1 < end:
                stack.append(data[pos + 1])
                pos += 2
            elif op == _MARK:
                self.metastack.append(stack)
                stack = []
                pos += 1
            elif op == _TUPLE:
                items = stack
                stack = self.metastack.pop()
                stack.append(tuple(items))
                pos += 1
            elif op == _TUPLE1:
                stack[-1] = (stack[-1],)
                pos += 1
            elif op == _LONG_BINPUT and pos + 4 < end:
                memo[_UINT4(data, pos + 1)[0]] = stack[-1]
                pos += 5
            elif op == _STOP:
                self.pos = pos + 1
                if self.metastack or len(stack) != 1:
                    raise Refused("malformed pickle (STOP with a wrong stack)")
                return stack.pop()
            else:
                handler = handlers.get(op)
                if handler is None:
                    raise Refused(f"unknown or unsupported opcode {op:#04x} at byte {pos}")
                self.pos, self.stack = pos + 1, stack
                handler(self)
                pos, stack = self.pos, self.stack

    # -- opcodes that push plain values

    def op_binput(self) -> None:
        self.memo[self.take(1)[0]] = self.stack[-1]

    def op_long_binput(self) -> None:
        self.memo[_UINT4(self.take(4))[0]] = self.stack[-1]

    def op_put(self) -> None:
        self.memo[int(self.line())] = self.stack[-1]

    def op_memoize(self) -> None:
        self.memo[len(self.memo)] = self.stack[-1]

    def op_binget(self) -> None:
        self.stack.append(self.memo[self.take(1)[0]])
        self.policy.budget += 1  # a reference, not a new object

    def op_long_binget(self) -> None:
        self.stack.append(self.memo[_UINT4(self.take(4))[0]])
        self.policy.budget += 1

    def op_get(self) -> None:
        self.stack.append(self.memo[int(self.line())])

    def op_mark(self) -> None:
        self.metastack.append(self.stack)
        self.stack = []

    def op_pop(self) -> None:
        if self.stack:
            self.stack.pop()
        else:
            self.pop_mark()

    def op_pop_mark(self) -> None:
        self.pop_mark()

    def op_dup(self) -> None:
        self.stack.append(self.stack[-1])

    def op_binunicode(self) -> None:
        self.stack.append(str(self.take(_UINT4(self.take(4))[0]), "utf-8", "surrogatepass"))

    def op_short_binunicode(self) -> None:
        self.stack.append(str(self.take(self.take(1)[0]), "utf-8", "surrogatepass"))

    def op_binunicode8(self) -> None:
        self.stack.append(str(self.take(_UINT8(self.take(8))[0]), "utf-8", "surrogatepass"))

    def op_unicode(self) -> None:
        self.stack.append(self.line().decode("raw-unicode-escape"))

    def op_binstring(self) -> None:  # a Python 2 str: text, as torch.load decodes it (utf-8)
        self.stack.append(bytes(self.take(_INT4(self.take(4))[0])).decode("utf-8"))

    def op_short_binstring(self) -> None:
        self.stack.append(bytes(self.take(self.take(1)[0])).decode("utf-8"))

    def op_string(self) -> None:
        text = self.line()
        if len(text) < 2 or text[0] != text[-1] or text[:1] not in (b"'", b'"'):
            raise Refused("a protocol 0 string without its quotes")
        self.stack.append(ast.literal_eval("b" + text.decode("latin-1")).decode("utf-8"))

    def op_binbytes(self) -> None:
        self.stack.append(bytes(self.take(_UINT4(self.take(4))[0])))

    def op_short_binbytes(self) -> None:
        self.stack.append(bytes(self.take(self.take(1)[0])))

    def op_binbytes8(self) -> None:
        self.stack.append(bytes(self.take(_UINT8(self.take(8))[0])))

    def op_bytearray8(self) -> None:
        self.stack.append(bytearray(self.take(_UINT8(self.take(8))[0])))

    def op_binint(self) -> None:
        self.stack.append(_INT4(self.take(4))[0])

    def op_binint1(self) -> None:
        self.stack.append(self.take(1)[0])

    def op_binint2(self) -> None:
        self.stack.append(_UINT2(self.take(2))[0])

    def op_int(self) -> None:
        text = self.line()
        self.stack.append({b"00": False, b"01": True}.get(text) if text in (b"00", b"01") else int(text))

    def op_long(self) -> None:
        self.stack.append(int(self.line().rstrip(b"L")))

    def op_long1(self) -> None:
        self.stack.append(int.from_bytes(self.take(self.take(1)[0]), "little", signed=True))

    def op_long4(self) -> None:
        self.stack.append(int.from_bytes(self.take(_INT4(self.take(4))[0]), "little", signed=True))

    def op_float(self) -> None:
        self.stack.append(float(self.line()))

    def op_binfloat(self) -> None:
        self.stack.append(_DOUBLE(self.take(8))[0])

    def op_none(self) -> None:
        self.stack.append(None)

    def op_newtrue(self) -> None:
        self.stack.append(True)

    def op_newfalse(self) -> None:
        self.stack.append(False)

    def op_proto(self) -> None:
        self.policy.proto = self.take(1)[0]

    def op_frame(self) -> None:
        self.take(8)  # a frame's length is advice for buffering: the opcodes are read as they come

    # -- containers

    def op_empty_tuple(self) -> None:
        self.stack.append(())

    def op_empty_list(self) -> None:
        self.stack.append([])

    def op_empty_dict(self) -> None:
        self.stack.append({})

    def op_empty_set(self) -> None:
        self.stack.append(set())

    def op_tuple(self) -> None:
        items = self.pop_mark()
        self.stack.append(tuple(items))

    def op_tuple1(self) -> None:
        self.stack[-1] = (self.stack[-1],)

    def op_tuple2(self) -> None:
        stack = self.stack
        stack[-2:] = [(stack[-2], stack[-1])]

    def op_tuple3(self) -> None:
        stack = self.stack
        stack[-3:] = [(stack[-3], stack[-2], stack[-1])]

    def op_list(self) -> None:
        self.stack.append(self.pop_mark())

    def op_dict(self) -> None:
        items = self.pop_mark()
        self.stack.append({dict_key(items[i]): items[i + 1] for i in range(0, len(items) - 1, 2)})

    def op_frozenset(self) -> None:
        self.stack.append(frozenset(set_elements(self.pop_mark())))

    def op_additems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) is set:
            target.update(set_elements(items))
        elif self.policy.mode is not Mode.SCAN:
            raise Refused(f"ADDITEMS on a {type(target).__name__}")

    def op_append(self) -> None:
        item = self.stack.pop()
        self._extend(self.stack[-1], [item])

    def op_appends(self) -> None:
        items = self.pop_mark()
        self._extend(self.stack[-1], items)

    def _extend(self, target: Any, items: list[Any]) -> None:
        if type(target) is list:
            target.extend(items)
        elif isinstance(target, StandInObject):
            target.elements.extend(items)
        elif self.policy.mode is not Mode.SCAN:
            raise Refused(f"APPEND on a {type(target).__name__}")

    def op_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._set_items(self.stack[-1], [key, value])

    def op_setitems(self) -> None:
        items = self.pop_mark()
        self._set_items(self.stack[-1], items)

    def _set_items(self, target: Any, items: list[Any]) -> None:
        if len(items) % 2:
            raise Refused("SETITEMS with a key and no value")
        if type(target) in DICTS:
            store = target
        elif isinstance(target, StandInObject):
            store = target.items
        elif self.policy.mode is Mode.SCAN:
            return
        else:
            raise Refused(f"SETITEM on a {type(target).__name__}")
        for i in range(0, len(items), 2):
            store[dict_key(items[i])] = items[i + 1]  # the type's __setitem__: an OrderedDict keeps its order

    # -- globals, calls, instances, persistent ids: the mode decides

    def op_global(self) -> None:
        module = self.line().decode("utf-8")
        name = self.line().decode("utf-8")
        self.stack.append(self.policy.find(module, name))

    def op_stack_global(self) -> None:
        name = self.stack.pop()
        module = self.stack.pop()
        if not (isinstance(module, str) and isinstance(name, str)):
            raise Refused("STACK_GLOBAL of something that is not a name")
        self.stack.append(self.policy.find(module, name))

    def op_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self.policy.call(self.stack[-1], args)

    def op_newobj(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self.policy.new(self.stack[-1], args, {})

    def op_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        if type(kwargs) is not dict:
            raise Refused("NEWOBJ_EX with keyword arguments that are not a dict")
        self.stack[-1] = self.policy.new(self.stack[-1], args, kwargs)

    def op_inst(self) -> None:  # protocols 0 and 1: a class named inline, its arguments after a mark
        module = self.line().decode("utf-8")
        name = self.line().decode("utf-8")
        cls = self.policy.find(module, name)
        args = tuple(self.pop_mark())
        self.stack.append(self.policy.call(cls, args) if args else self.policy.new(cls, (), {}))

    def op_obj(self) -> None:
        items = self.pop_mark()
        if not items:
            raise Refused("OBJ without a class")
        cls, args = items[0], tuple(items[1:])
        self.stack.append(self.policy.call(cls, args) if args else self.policy.new(cls, (), {}))

    def op_build(self) -> None:
        state = self.stack.pop()
        self.policy.build(self.stack[-1], state)

    def op_binpersid(self) -> None:
        self.stack[-1] = self.policy.persistent(self.stack[-1])

    def op_persid(self) -> None:
        self.stack.append(self.policy.persistent(self.line().decode("ascii")))

    def op_ext(self) -> None:
        raise Refused("an extension-registry global (EXT opcodes): not read")

    def op_buffer(self) -> None:
        raise Refused("an out-of-band buffer (protocol 5): not read")


_M = _Machine
_HANDLERS: dict[int, Callable[[_Machine], None]] = {
    _OP["BINPUT"]: _M.op_binput,
    _OP["LONG_BINPUT"]: _M.op_long_binput,
    _OP["PUT"]: _M.op_put,
    _OP["MEMOIZE"]: _M.op_memoize,
    _OP["BINGET"]: _M.op_binget,
    _OP["LONG_BINGET"]: _M.op_long_binget,
    _OP["GET"]: _M.op_get,
    _OP["MARK"]: _M.op_mark,
    _OP["POP"]: _M.op_pop,
    _OP["POP_MARK"]: _M.op_pop_mark,
    _OP["DUP"]: _M.op_dup,
    _OP["BINUNICODE"]: _M.op_binunicode,
    _OP["SHORT_BINUNICODE"]: _M.op_short_binunicode,
    _OP["BINUNICODE8"]: _M.op_binunicode8,
    _OP["UNICODE"]: _M.op_unicode,
    _OP["BINSTRING"]: _M.op_binstring,
    _OP["SHORT_BINSTRING"]: _M.op_short_binstring,
    _OP["STRING"]: _M.op_string,
    _OP["BINBYTES"]: _M.op_binbytes,
    _OP["SHORT_BINBYTES"]: _M.op_short_binbytes,
    _OP["BINBYTES8"]: _M.op_binbytes8,
    _OP["BYTEARRAY8"]: _M.op_bytearray8,
    _OP["BININT"]: _M.op_binint,
    _OP["BININT1"]: _M.op_binint1,
    _OP["BININT2"]: _M.op_binint2,
    _OP["INT"]: _M.op_int,
    _OP["LONG"]: _M.op_long,
    _OP["LONG1"]: _M.op_long1,
    _OP["LONG4"]: _M.op_long4,
    _OP["FLOAT"]: _M.op_float,
    _OP["BINFLOAT"]: _M.op_binfloat,
    _OP["NONE"]: _M.op_none,
    _OP["NEWTRUE"]: _M.op_newtrue,
    _OP["NEWFALSE"]: _M.op_newfalse,
    _OP["PROTO"]: _M.op_proto,
    _OP["FRAME"]: _M.op_frame,
    _OP["EMPTY_TUPLE"]: _M.op_empty_tuple,
    _OP["EMPTY_LIST"]: _M.op_empty_list,
    _OP["EMPTY_DICT"]: _M.op_empty_dict,
    _OP["EMPTY_SET"]: _M.op_empty_set,
    _OP["TUPLE"]: _M.op_tuple,
    _OP["TUPLE1"]: _M.op_tuple1,
    _OP["TUPLE2"]: _M.op_tuple2,
    _OP["TUPLE3"]: _M.op_tuple3,
    _OP["LIST"]: _M.op_list,
    _OP["DICT"]: _M.op_dict,
    _OP["FROZENSET"]: _M.op_frozenset,
    _OP["ADDITEMS"]: _M.op_additems,
    _OP["APPEND"]: _M.op_append,
    _OP["APPENDS"]: _M.op_appends,
    _OP["SETITEM"]: _M.op_setitem,
    _OP["SETITEMS"]: _M.op_setitems,
    _OP["GLOBAL"]: _M.op_global,
    _OP["STACK_GLOBAL"]: _M.op_stack_global,
    _OP["REDUCE"]: _M.op_reduce,
    _OP["NEWOBJ"]: _M.op_newobj,
    _OP["NEWOBJ_EX"]: _M.op_newobj_ex,
    _OP["INST"]: _M.op_inst,
    _OP["OBJ"]: _M.op_obj,
    _OP["BUILD"]: _M.op_build,
    _OP["BINPERSID"]: _M.op_binpersid,
    _OP["PERSID"]: _M.op_persid,
    _OP["EXT1"]: _M.op_ext,
    _OP["EXT2"]: _M.op_ext,
    _OP["EXT4"]: _M.op_ext,
    _OP["NEXT_BUFFER"]: _M.op_buffer,
    _OP["READONLY_BUFFER"]: _M.op_buffer,
}
