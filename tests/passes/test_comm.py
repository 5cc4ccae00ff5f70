"""The comm ops' autograd across a detached boundary equals plain autograd."""
import pytest
import torch

from passes import comm


def _two_stage(x, w1, w2, transport_a, transport_b, move):
    with comm.bind(transport_a):
        token = comm.send(torch.tanh(x @ w1), "h", 1)
    move()
    with comm.bind(transport_b):
        h = comm.recv("h", 0, tuple(x.shape[:1]) + (w1.shape[1],), x.dtype, True)
        loss = (h @ w2).pow(2).sum()
    return token, loss


def test_mailbox_gradients_match_unsplit():
    torch.manual_seed(0)
    x = torch.randn(4, 3, dtype=torch.float64)
    w1 = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    ref = (torch.tanh(x @ w1) @ w2).pow(2).sum()
    g1, g2 = torch.autograd.grad(ref, [w1, w2])

    a, b = comm.MailboxTransport(), comm.MailboxTransport()
    token, loss = _two_stage(x, w1, w2, a, b, lambda: b.inbox.update(h=a.outbox.pop("h")))
    assert torch.equal(loss.detach(), ref.detach())
    loss.backward()
    a.grad_in["h"] = b.grad_out.pop("h")
    torch.autograd.backward([token], [torch.ones(())])
    assert torch.allclose(w1.grad, g1) and torch.allclose(w2.grad, g2)


def test_connected_transport_keeps_autograd():
    x = torch.randn(2, 3)
    w1 = torch.randn(3, 3, requires_grad=True)
    w2 = torch.randn(3, 1, requires_grad=True)
    t = comm.ConnectedTransport()
    token, loss = _two_stage(x, w1, w2, t, t, lambda: None)
    assert token is None
    loss.backward()
    assert w1.grad is not None and w1.grad.abs().sum() > 0


def test_unbound_op_names_tag_and_way_out():
    with pytest.raises(comm.CommError, match=r"recv\('act_3'\).*run_local"):
        comm.recv("act_3", 0)


def test_missing_gradient_is_an_error_not_zero():
    a = comm.MailboxTransport()
    w = torch.randn(2, requires_grad=True)
    with comm.bind(a):
        token = comm.send(w * 2, "v", 1)
    with pytest.raises(comm.CommError, match="'v'.*not received"):
        torch.autograd.backward([token], [torch.ones(())])


def test_received_tensor_is_a_copy_that_in_place_ops_may_change():
    """In-process, the inbox holds the sender's tensor: an in-place op after recv must not reach it. A
    runtime's own buffer (``owns_inbox``) becomes a leaf and the stage gets a clone of it, so in-place
    ops stay legal there too; its gradient reaches ``grad_out`` at ``collect_grads``."""
    w = torch.randn(3, requires_grad=True)
    for owns in (False, True):
        w.grad = None
        a, b = comm.MailboxTransport(), comm.MailboxTransport(owns_inbox=owns)
        with comm.bind(a):
            h = torch.tanh(w)  # tanh saves its output for backward
            token = comm.send(h, "h", 1)
        sent = a.outbox.pop("h")
        inbox = sent if not owns else sent.clone()  # owned: a runtime's own receive buffer
        b.inbox["h"] = inbox
        with comm.bind(b):
            r = comm.recv("h", 0, (3,), torch.float32, requires_grad=True)
            assert r.data_ptr() != inbox.data_ptr() and r.grad_fn is not None
            loss = r.mul_(2).sum()
        loss.backward()
        assert ("h" in b.grad_out) != owns  # an owned buffer's gradient waits in the leaf's .grad
        b.collect_grads()
        assert not b.leaves
        a.grad_in["h"] = b.grad_out.pop("h")
        torch.autograd.backward([token], [torch.ones(())])  # fails if the receiver changed tanh's output
        assert torch.allclose(w.grad, 2 * (1 - torch.tanh(w.detach()) ** 2))


def test_sent_as_roots_gives_no_token_and_backward_starts_at_the_sent_value():
    """The runtime's mailbox: a differentiable sent value is kept, ``send`` returns no token, and the
    backward from ``backward_roots`` gives the weights the gradient the token path would; a gradient
    that never arrived is an error naming the tag."""
    w = torch.randn(3, requires_grad=True)
    box = comm.MailboxTransport(owns_inbox=True, sent_as_roots=True)
    with comm.bind(box):
        assert comm.send(torch.tanh(w), "h", 1) is None
    assert torch.equal(box.outbox["h"], torch.tanh(w.detach())) and not box.outbox["h"].requires_grad
    with pytest.raises(comm.CommError, match="'h'.*not received"):
        box.backward_roots()
    box.grad_in["h"] = torch.full((3,), 2.0)
    torch.autograd.backward(*box.backward_roots())
    assert torch.allclose(w.grad, 2 * (1 - torch.tanh(w.detach()) ** 2))
