"""Routes: v2_watch (being written)."""

from fastapi import APIRouter

router = APIRouter()
