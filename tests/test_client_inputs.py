"""The client library refuses what it cannot send, in words, before anything leaves: numpy cut
token id 1.5 to 1 in silence and read "abc" as an error about int(); a negative timeout was zmq's
"Invalid argument"; a prompt that was not text reached the broker, which counted it malformed;
`tokenize()` with nothing to tokenize asked the broker too; a closed client was used again."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from nebula_flow.client import AsyncClient, Client, build_submit, build_tokenize, token_array


def test_token_ids_are_a_list_of_ints_whatever_holds_them() -> None:
    for ids in ([5, 6], (5, 6), np.array([5, 6], dtype=np.int64), list(np.array([5, 6])), torch.tensor([5, 6])):
        out = token_array(ids)
        assert out.dtype == np.int32 and out.tolist() == [5, 6]
    for ids, said in (([1.5, 2], "got 1.5"), ([True], "got True"), ([-1], "got -1"), ([2**40], "got 1099511627776"),
                      ([[5, 6]], "got [5, 6]"), ("abc", "a list of token ids (ints >= 0), got str"), (7, "got int"),
                      ([None], "got None")):
        with pytest.raises(ValueError, match=f"token_ids must be .*{re.escape(said)}"):
            token_array(ids)


def test_a_submit_refuses_a_prompt_that_is_not_text_and_bad_ids_anywhere() -> None:
    with pytest.raises(ValueError, match=r"prompt must be text, got int \(token ids go in token_ids=\)"):
        build_submit("r", 5, None, False)
    with pytest.raises(ValueError, match="token_ids must be a list of token ids"):
        build_submit("r", None, [1, 2.5], False)
    with pytest.raises(ValueError, match=r"prediction must be text or a list of token ids \(ints >= 0\), got \[5\]"):
        build_submit("r", "hi", None, False, prediction=[[5]])
    sent = build_submit("r", None, np.array([3, 4]), False, prediction=(7, 8))
    assert sent.prompt_tokens.tolist() == [3, 4] and sent.prediction_tokens.tolist() == [7, 8]


def test_tokenize_needs_exactly_one_thing_to_tokenize() -> None:
    with pytest.raises(ValueError, match="give exactly one of text, messages and token_ids"):
        build_tokenize()
    with pytest.raises(ValueError, match="give exactly one"):
        build_tokenize("hi", token_ids=[1])
    with pytest.raises(ValueError, match="got -5"):
        build_tokenize(token_ids=[-5])
    assert build_tokenize(token_ids=[1, 2]).token_ids.tolist() == [1, 2]


@pytest.mark.parametrize("cls", [Client, AsyncClient])
def test_a_client_with_no_time_to_wait_or_negative_retries_is_refused(cls: type) -> None:
    for kw, said in ((dict(timeout_s=0), "timeout_s must be > 0 seconds, got 0"),
                     (dict(timeout_s=-1.0), "timeout_s must be > 0 seconds, got -1.0"),
                     (dict(retries=-1), "retries must be an int >= 0, got -1"),
                     (dict(retries=1.5), "retries must be an int >= 0, got 1.5")):
        with pytest.raises(ValueError, match=said):
            cls("tcp://127.0.0.1:9", **kw)


def test_a_closed_client_says_so() -> None:
    """A closed AsyncClient's next request was a ZMQError traceback ("Socket operation on
    non-socket"); a closed Client quietly opened new sockets nobody would close."""
    import asyncio

    from nebula_flow.client import NebulaError

    client = Client("tcp://127.0.0.1:9")
    client.close()
    with pytest.raises(NebulaError, match="this client is closed"):
        client.status()

    async def closed_async() -> None:
        async with AsyncClient("tcp://127.0.0.1:9") as aclient:
            pass
        await aclient.generate(token_ids=[1, 2], max_new_tokens=2)

    with pytest.raises(NebulaError, match="this client is closed"):
        asyncio.run(closed_async())
